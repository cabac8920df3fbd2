"""Qwen-Image MMDiT: the whole model in one file, with diffusers' parameter names (DESIGN §1).

Norm, modulate, gated-residual and q/k norm+RoPE steps go through `qwen_image_fusion.kernels.seam`; the
producer modules (`NormModulate`, `ResidualNormModulate`) are where `post_load_weights` plugs in fused FP8
paths, so the block forward below stays free of special cases.

Edit-2511's `zero_cond_t` is data, not a branch: the image stream's conditioning `temb` has 2B rows (the
step's t, then t = 0) and `mod_index` [B, L] names each image token's modulation row (target tokens row b,
reference-image tokens row B + b); the text stream and `norm_out` use the first B rows. Without it `temb`
has B rows and `mod_index` is None (per-sample rows). The image token layout (`ImageLayout`: target grid,
then reference grids) is host data, so a step stays free of host syncs and capturable in a CUDA graph.
"""

import torch
from torch import nn

from qwen_image_fusion.kernels.numerics import Numerics
from qwen_image_fusion.kernels.reference import rms_norm_reference
from qwen_image_fusion.kernels.seam import (
    gelu,
    gelu_quant,
    norm_modulate,
    norm_modulate_nvfp4,
    norm_modulate_quant,
    residual_add,
    residual_norm_modulate,
    residual_norm_modulate_nvfp4,
    residual_norm_modulate_quant,
)
from qwen_image_fusion.models.blocks import EPS, Producer, QKNorm, gate_blocks
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.fp8 import FP8_STATIC_KEY, Fp8Linear, QuantizedActivation
from qwen_image_fusion.models.fusion import (
    FusionReport,
    PathDecision,
    configure_norm_quant,
)
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.numerics import NumericsAware, set_numerics
from qwen_image_fusion.models.nvfp4 import NVFP4_KEY
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.math import (
    Grid,
    ImageLayout,
    Rope,
    joint_attention,
    joint_key_mask,
    rope_frequencies,
    rope_tables,
    timestep_embedding,
)
from qwen_image_fusion.models.sequence_parallel import SequencePlan
from qwen_image_fusion.models.step_cache import Streams, run_blocks


class RMSNorm(nn.Module):
    """RMSNorm with weight, rounding as diffusers' `RMSNorm`."""

    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)


class NormModulate(Producer):
    """Producer 1: `modulate(LN(x), shift, scale)` feeding Q/K/V (or the output projection); modulation
    rows per sample, or per token through `mod_index` (qwen_image_fusion.kernels.seam). Writes FP8, or
    NVFP4 for W4A4 consumers."""

    quant_keys = (FP8_STATIC_KEY, NVFP4_KEY)

    def forward(
        self,
        x: torch.Tensor,
        shift: torch.Tensor,
        scale: torch.Tensor,
        mod_index: torch.Tensor | None = None,
    ) -> torch.Tensor | QuantizedActivation:
        quant = self.quant
        if quant is None:
            return norm_modulate(x, shift, scale, self.eps, self.numerics, mod_index)
        if quant.quant_key == NVFP4_KEY:
            y, q, s = norm_modulate_nvfp4(
                x, shift, scale, self.eps, quant.inv_scale, quant.write_y, quant.write_q, mod_index
            )
            return y if q is None else self.quantized(y, q, x.dtype, s)
        y, q = norm_modulate_quant(x, shift, scale, self.eps, quant.inv_scale, quant.write_y, mod_index)
        return self.quantized(y, q, x.dtype)


class ResidualNormModulate(Producer):
    """Producer 2: `r = residual + gate * x; y = modulate(LN(r))`; returns `(r, y)` (y FP8, or NVFP4 for W4A4
    consumers, where they are quantized)."""

    quant_keys = (FP8_STATIC_KEY, NVFP4_KEY)

    def forward(
        self,
        residual: torch.Tensor,
        gate: torch.Tensor,
        x: torch.Tensor,
        shift: torch.Tensor,
        scale: torch.Tensor,
        mod_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | QuantizedActivation]:
        quant = self.quant
        if quant is None:
            return residual_norm_modulate(residual, gate, x, shift, scale, self.eps, self.numerics, mod_index)
        if quant.quant_key == NVFP4_KEY:
            r, y, q, s = residual_norm_modulate_nvfp4(
                residual,
                gate,
                x,
                shift,
                scale,
                self.eps,
                quant.inv_scale,
                quant.write_y,
                quant.write_q,
                mod_index,
            )
            return r, y if q is None else self.quantized(y, q, r.dtype, s)
        r, y, q = residual_norm_modulate_quant(
            residual, gate, x, shift, scale, self.eps, quant.inv_scale, quant.write_y, mod_index
        )
        return r, self.quantized(y, q, r.dtype)


class GatedResidual(NumericsAware, nn.Module):
    """`residual + gate * x` after the MLP."""

    def forward(
        self,
        residual: torch.Tensor,
        gate: torch.Tensor,
        x: torch.Tensor,
        mod_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return residual_add(residual, gate, x, self.numerics, mod_index)


class GeluProjection(Producer):
    """`net.0`: Linear then GELU(tanh); a producer for an FP8 `net.2`."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor | QuantizedActivation:
        h = self.proj(x)
        if self.quant is None:
            return gelu(h, self.numerics)
        g, q = gelu_quant(h, self.quant.inv_scale, self.quant.write_y)
        return self.quantized(g, q, h.dtype)


class FeedForward(nn.Module):
    """MLP with diffusers' names: `net.0.proj` (D -> 4D), GELU(tanh), `net.2` (4D -> D)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.net[2](self.net[0](x))


def joint_rows(txt: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
    """An empty [B, S_txt + S_img, H, D] buffer for the joint sequence of two [B, S, H, D] streams."""
    batch, seq_txt, *head = txt.shape
    return txt.new_empty(batch, seq_txt + img.shape[1], *head)


def rows_for(linear: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """A row slice of the joint sequence as `linear` takes it: in place where the consumer reads slices
    (the FP8 quantizer does, saving a copy), else contiguous like diffusers (same GEMM, same bits)."""
    return rows if getattr(linear, "reads_row_slices", False) else rows.contiguous()


class JointAttention(nn.Module):
    """Joint text+image attention: per-stream QKV, per-head RMSNorm on q/k, RoPE, order [text, image]."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner) for _ in range(3))
        self.norm_q, self.norm_k = QKNorm(head_dim), QKNorm(head_dim)
        self.norm_added_q, self.norm_added_k = QKNorm(head_dim), QKNorm(head_dim)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.to_add_out = nn.Linear(inner, dim)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        key_mask: torch.Tensor | None,
        rope: Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        heads = (-1, self.head_dim)
        img_q, img_k, img_v = (p(img).unflatten(-1, heads) for p in (self.to_q, self.to_k, self.to_v))
        txt_q, txt_k, txt_v = (
            p(txt).unflatten(-1, heads) for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        )

        # normalized, rotated q and k go straight into their rows of the joint [text, image] sequence
        seq_txt = txt_q.shape[1]
        query, key = joint_rows(txt_q, img_q), joint_rows(txt_k, img_k)
        self.norm_added_q(txt_q, rope.txt, out=query[:, :seq_txt])
        self.norm_q(img_q, rope.img, out=query[:, seq_txt:])
        self.norm_added_k(txt_k, rope.txt, out=key[:, :seq_txt])
        self.norm_k(img_k, rope.img, out=key[:, seq_txt:])
        value = torch.cat([txt_v, img_v], dim=1)
        out = joint_attention(query, key, value, key_mask).flatten(2, 3).to(query.dtype)

        img_out = self.to_out[0](rows_for(self.to_out[0], out[:, seq_txt:, :]))
        txt_out = self.to_add_out(rows_for(self.to_add_out, out[:, :seq_txt, :]))
        return img_out, txt_out


class QwenImageTransformerBlock(nn.Module):
    """Dual-stream MMDiT block (DESIGN §1 block forward)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1, self.txt_norm1 = NormModulate(), NormModulate()
        self.attn = JointAttention(dim, heads, head_dim)
        self.img_norm2, self.txt_norm2 = ResidualNormModulate(), ResidualNormModulate()
        self.img_mlp, self.txt_mlp = FeedForward(dim), FeedForward(dim)
        self.img_residual, self.txt_residual = GatedResidual(), GatedResidual()

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None,
        temb: torch.Tensor,
        rope: Rope,
        mod_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb[: encoder_hidden_states.shape[0]]).chunk(2, dim=-1)
        img_shift1, img_scale1, img_gate1 = img_mod1.chunk(3, dim=-1)
        img_shift2, img_scale2, img_gate2 = img_mod2.chunk(3, dim=-1)
        txt_shift1, txt_scale1, txt_gate1 = txt_mod1.chunk(3, dim=-1)
        txt_shift2, txt_scale2, txt_gate2 = txt_mod2.chunk(3, dim=-1)

        img_in = self.img_norm1(hidden_states, img_shift1, img_scale1, mod_index)
        txt_in = self.txt_norm1(encoder_hidden_states, txt_shift1, txt_scale1)
        img_attn, txt_attn = self.attn(img_in, txt_in, key_mask, rope)

        hidden_states, img_mlp_in = self.img_norm2(
            hidden_states, img_gate1, img_attn, img_shift2, img_scale2, mod_index
        )
        hidden_states = self.img_residual(hidden_states, img_gate2, self.img_mlp(img_mlp_in), mod_index)

        encoder_hidden_states, txt_mlp_in = self.txt_norm2(
            encoder_hidden_states, txt_gate1, txt_attn, txt_shift2, txt_scale2
        )
        encoder_hidden_states = self.txt_residual(encoder_hidden_states, txt_gate2, self.txt_mlp(txt_mlp_in))
        return encoder_hidden_states, hidden_states

    def producer_paths(self) -> dict[str, tuple[Producer, list[tuple[str, nn.Module]]]]:
        """Each producer and the linears that consume its output, by path name."""
        a = self.attn
        return {
            "img_attn_input": (self.img_norm1, [("to_q", a.to_q), ("to_k", a.to_k), ("to_v", a.to_v)]),
            "txt_attn_input": (
                self.txt_norm1,
                [("add_q_proj", a.add_q_proj), ("add_k_proj", a.add_k_proj), ("add_v_proj", a.add_v_proj)],
            ),
            "img_mlp_input": (self.img_norm2, [("img_mlp.net.0.proj", self.img_mlp.net[0].proj)]),
            "txt_mlp_input": (self.txt_norm2, [("txt_mlp.net.0.proj", self.txt_mlp.net[0].proj)]),
            "img_mlp_hidden": (self.img_mlp.net[0], [("img_mlp.net.2", self.img_mlp.net[2])]),
            "txt_mlp_hidden": (self.txt_mlp.net[0], [("txt_mlp.net.2", self.txt_mlp.net[2])]),
        }

    def post_load_weights(self, fuse: bool = True, prefix: str = "") -> list[PathDecision]:
        """Decide once, after loading, which producer paths write FP8 directly (the DESIGN §4 gate)."""
        device = self.attn.norm_q.weight.device  # a plain parameter: linears may be wrapped (LoRA)
        return [
            configure_norm_quant(producer, f"{prefix}{name}", consumers, device, fuse)
            for name, (producer, consumers) in self.producer_paths().items()
        ]


class TransformerBlocks(nn.ModuleList):
    """The block stack as one module, so sequence parallelism has one place to split the joint rows."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None,
        temb: torch.Tensor,
        rope: Rope,
        mod_index: torch.Tensor | None = None,
        control: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Image rows after every block (the text rows only feed the attention); a step cache, when one is
        active, may skip the middle blocks (models/step_cache.py). `control`: a ControlNet's residuals,
        added to the image rows after the blocks, each serving ceil(blocks / residuals) blocks in turn."""
        every = -(-len(self) // len(control)) if control else 0

        def run(i: int, streams: Streams) -> Streams:
            text, image = self[i](streams[0], streams[1], key_mask, temb, rope, mod_index)
            if control:
                image = image + control[i // every]
            return image, text

        return run_blocks(len(self), (hidden_states, encoder_hidden_states), run)[0]


class TimestepEmbedder(nn.Module):
    """`time_text_embed.timestep_embedder`: linear_1 -> SiLU -> linear_2."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(256, dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    """Sigma -> conditioning vector `temb` [B, D]; with `additional_t_cond` (Qwen-Image-Layered) plus the
    task embedding's row 0, the one diffusers' `QwenImageLayeredPipeline` always passes (`is_rgb` 0)."""

    def __init__(self, dim: int, additional_t_cond: bool = False) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(dim)
        self.addition_t_embedding = nn.Embedding(2, dim) if additional_t_cond else None

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        temb = self.timestep_embedder(timestep_embedding(timestep).to(dtype))
        if self.addition_t_embedding is None:
            return temb
        task = torch.zeros(timestep.shape[0], dtype=torch.long, device=timestep.device)
        return temb + self.addition_t_embedding(task).to(dtype)


class OutputNorm(nn.Module):
    """`norm_out`: LN then `x*(1+scale)+shift`, the 2D-wide projection split scale first."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = NormModulate()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(self.silu(temb).to(x.dtype)).chunk(2, dim=1)
        return self.norm(x, shift, scale)


class QwenImageTransformer(nn.Module):
    """The Qwen-Image DiT; `forward` matches diffusers' `QwenImageTransformer2DModel.forward`."""

    # Ulysses sequence parallelism (models/sequence_parallel.py): the blocks' image rows, text rows, their
    # RoPE rows and the image rows' modulation index split over the ranks (the key mask stays whole); image
    # rows gather before `proj_out`.
    sequence_parallel_plan = SequencePlan(
        split="transformer_blocks",
        image_rows="hidden_states",
        text_rows="encoder_hidden_states",
        rope="rope",
        gather="norm_out",
        image_index="mod_index",
    )

    def __init__(self, config: QwenImageConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.time_text_embed = TimeTextEmbed(dim, config.use_additional_t_cond)
        self.txt_norm = RMSNorm(config.joint_attention_dim)
        self.img_in = nn.Linear(config.in_channels, dim)
        self.txt_in = nn.Linear(config.joint_attention_dim, dim)
        self.transformer_blocks = TransformerBlocks(
            QwenImageTransformerBlock(dim, config.num_attention_heads, config.attention_head_dim)
            for _ in range(config.num_layers)
        )
        self.norm_out = OutputNorm(dim)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.out_channels)
        self.quant_config: QuantConfig | None = None
        self._rope_tables = rope_tables(config.axes_dims_rope)
        self._device_rope_tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._rope_cache: dict[tuple, Rope] = {}

    @property
    def is_fp8(self) -> bool:
        return any(isinstance(m, Fp8Linear) for m in self.modules())

    def set_numerics(self, numerics: Numerics | str) -> None:
        """Select reference (diffusers op for op) or contract (DESIGN §4) arithmetic for every producer."""
        set_numerics(self, numerics)

    def post_load_weights(self, fuse: bool | None = None) -> FusionReport:
        """Run once after the weights are in place: FP8 inverse scales, then every block's fusion gate
        (models/blocks.py `gate_blocks`); `fuse=False` or QWEN_IMAGE_FP8_FUSION=0 forces the unfused path."""
        self.fusion_report = gate_blocks(self, fuse)
        return self.fusion_report

    def rope(self, layout: ImageLayout, text_len: int, device: torch.device) -> Rope:
        """Cached image and text RoPE rotations on `device` (computed once per layout and text length)."""
        key = (layout, text_len, device)
        if key not in self._rope_cache:
            if device not in self._device_rope_tables:  # copied to the device once, not per shape
                self._device_rope_tables[device] = tuple(t.to(device) for t in self._rope_tables)
            tables = self._device_rope_tables[device]
            self._rope_cache[key] = rope_frequencies(
                tables, self.config.axes_dims_rope, layout, text_len, self.config.use_layer3d_rope
            )
        return self._rope_cache[key]

    def conditioning_timesteps(self, timestep: torch.Tensor) -> torch.Tensor:
        """The timesteps of `temb`'s rows: [B], or with `zero_cond_t` [2B], the step's then t = 0."""
        return torch.cat([timestep, timestep * 0]) if self.config.zero_cond_t else timestep

    def modulation_index(self, layout: ImageLayout, batch: int, device: torch.device) -> torch.Tensor | None:
        """Per-token modulation rows of the image stream (int32 [B, L]): with `zero_cond_t`, sample b's
        target tokens take row b of `temb`, its reference tokens row B + b (diffusers' `modulate_index`).
        Made on the device from host ints: no copy from the host, nothing to sync."""
        if not self.config.zero_cond_t:
            return None
        reference = (torch.arange(layout.tokens, device=device) >= layout.target_tokens).to(torch.int32)
        return torch.arange(batch, dtype=torch.int32, device=device)[:, None] + batch * reference

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        layout: ImageLayout | Grid,
        control: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Velocity for packed latents [B, tokens, 64] at sigma `timestep` [B] (already divided by 1000).

        `layout`: the image tokens' grids, target first (a plain (F, H, W) grid for text-to-image); the
        output covers every image token, the caller keeps the target's (Edit: `out[:, :target_tokens]`).
        `control`: a ControlNet's residuals for the blocks (models/qwen_image/controlnet.py).
        """
        layout = ImageLayout.of(layout)
        if hidden_states.shape[1] != layout.tokens:
            raise InputError(f"{hidden_states.shape[1]} image tokens, but {layout} has {layout.tokens}")
        hidden_states = self.img_in(hidden_states)
        timestep = timestep.to(hidden_states.dtype)
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))
        mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.to(torch.bool)
        temb = self.time_text_embed(self.conditioning_timesteps(timestep), hidden_states.dtype)
        device, batch = hidden_states.device, hidden_states.shape[0]
        hidden_states = self.transformer_blocks(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            key_mask=joint_key_mask(mask, hidden_states.shape[1]),
            temb=temb,
            rope=self.rope(layout, encoder_hidden_states.shape[1], device),
            mod_index=self.modulation_index(layout, batch, device),
            control=control,
        )
        return self.proj_out(self.norm_out(hidden_states, temb[:batch]))
