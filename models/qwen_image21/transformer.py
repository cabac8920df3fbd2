"""Qwen-Image 2.1 single-stream DiT in one file, with diffusers' module names and state-dict keys.

The block forward is the math only: producers (`ScaleNorm`, `TanhResidualScaleNorm`, `SwiGLU`) take each
token's modulation row as data (`ModulationRows`, built once per request in `layout.py`), and
`post_load_weights` decides once whether each of them writes FP8 for its consumers. Which rows a pass
computes, and which keys its attention reads, is data too (`PassPlan`, `PrefixKVCache`), so the full
(first) pass and the target-only (KV-cached) step run the same blocks.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from qwen_image_fusion.kernels.reference import zero_centered_rms_norm_reference
from qwen_image_fusion.kernels.scale_modulate import ModulationRows, TanhGate
from qwen_image_fusion.kernels.seam import (
    Numerics,
    norm_scale,
    norm_scale_quant,
    swiglu,
    swiglu_quant,
    tanh_residual,
    tanh_residual_norm_scale,
    tanh_residual_norm_scale_quant,
)
from qwen_image_fusion.models.blocks import Producer, QKNorm, gate_blocks
from qwen_image_fusion.models.fp8 import Fp8Linear, QuantizedActivation
from qwen_image_fusion.models.fusion import FusionReport, PathDecision, configure_norm_quant
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.numerics import NumericsAware, set_numerics
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.layout import (
    PassPlan,
    PrefixKVCache,
    TokenLayout,
    TransientKV,
    build_layout,
    rope_tables,
)
from qwen_image_fusion.models.step_cache import run_blocks

TIMESTEP_CHANNELS = 256


class ScaleNorm(Producer):
    """Producer (a): `LN(x) * (1 + scale[row])` feeding Q/K/V (and, unquantized, `norm_out`)."""

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor, rows: ModulationRows
    ) -> torch.Tensor | QuantizedActivation:
        if self.quant is None:
            return norm_scale(x, scale, rows, self.eps, self.numerics)
        y, q = norm_scale_quant(x, scale, rows, self.eps, self.quant.inv_scale, self.quant.write_y)
        return self.quantized(y, q, x.dtype)


class TanhResidualScaleNorm(Producer):
    """Producer (b): `r = residual + tanh(gate[row]) * x; y = LN(r) * (1 + scale[row])`; returns `(r, y)`."""

    def forward(
        self,
        residual: torch.Tensor,
        gate: TanhGate,
        x: torch.Tensor,
        scale: torch.Tensor,
        rows: ModulationRows,
    ) -> tuple[torch.Tensor, torch.Tensor | QuantizedActivation]:
        if self.quant is None:
            return tanh_residual_norm_scale(residual, gate, x, scale, rows, self.eps, self.numerics)
        r, y, q = tanh_residual_norm_scale_quant(
            residual, gate, x, scale, rows, self.eps, self.quant.inv_scale, self.quant.write_y
        )
        return r, self.quantized(y, q, r.dtype)


class TanhResidual(NumericsAware, nn.Module):
    """`residual + tanh(gate[row]) * x` after the MLP."""

    def forward(
        self, residual: torch.Tensor, gate: TanhGate, x: torch.Tensor, rows: ModulationRows
    ) -> torch.Tensor:
        return tanh_residual(residual, gate, x, rows, self.numerics)


class SwiGLU(Producer):
    """diffusers' `QwenImage21SwiGLUFeedForward` (`proj`, `out`, `gate_layer`); producer (c) of `out`'s
    input `silu(gate_layer(x)) * proj(x)`."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=False)
        self.out = nn.Linear(hidden, dim, bias=False)
        self.gate_layer = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        g, p = self.gate_layer(x), self.proj(x)
        if self.quant is None:
            return self.out(swiglu(g, p, self.numerics))
        y, q = swiglu_quant(g, p, self.quant.inv_scale, self.quant.write_y)
        return self.out(self.quantized(y, q, g.dtype))


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """SDPA over [B, S, H, D] inputs as diffusers' native backend calls it."""
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.permute(0, 2, 1, 3)


class Attention(nn.Module):
    """Q/K/V, per-head RMSNorm + RoPE, the pass's SDPA calls over the joint key/value buffers, `to_out`.

    q goes to a fresh tensor; k and v go into rows `[plan.start, S)` of the layer's key/value buffers (a
    cache or per-pass buffers), and each call attends to keys `[0, key_end)` of them.
    """

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False), nn.Dropout(0.0)])
        self.norm_q, self.norm_k = QKNorm(head_dim, eps), QKNorm(head_dim, eps)

    def forward(
        self, x: torch.Tensor | QuantizedActivation, plan: PassPlan, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        key, value = kv
        heads = (-1, self.head_dim)
        q, k, v = (p(x).unflatten(-1, heads) for p in (self.to_q, self.to_k, self.to_v))
        query = self.norm_q(q, plan.rope, None)
        self.norm_k(k, plan.rope, out=key[:, plan.start :])
        value[:, plan.start :].copy_(v)
        outs = [
            attend(query[:, c.query_start : c.query_end], key[:, : c.key_end], value[:, : c.key_end], c.mask)
            for c in plan.calls
        ]
        return self.to_out[0](torch.cat(outs, dim=1).flatten(2, 3))


class Modulation(NamedTuple):
    """The shared modulation of one forward, split as diffusers does: [scale1, gate1, scale2, gate2]."""

    scale1: torch.Tensor
    gate1: TanhGate
    scale2: torch.Tensor
    gate2: TanhGate


class QwenImage21Block(nn.Module):
    """Single-stream block (diffusers' `QwenImage21TransformerBlock`); no parameters of its own modulation."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_dim: int, eps: float) -> None:
        super().__init__()
        self.img_norm1 = ScaleNorm(eps)
        self.attn = Attention(dim, heads, head_dim, eps)
        self.img_norm2 = TanhResidualScaleNorm(eps)
        self.img_mlp = SwiGLU(dim, mlp_dim)
        self.mlp_residual = TanhResidual()

    def forward(
        self, x: torch.Tensor, mod: Modulation, plan: PassPlan, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        attn_out = self.attn(self.img_norm1(x, mod.scale1, plan.rows), plan, kv)
        x, mlp_in = self.img_norm2(x, mod.gate1, attn_out, mod.scale2, plan.rows)
        return self.mlp_residual(x, mod.gate2, self.img_mlp(mlp_in), plan.rows)

    def producer_paths(self) -> dict[str, tuple[Producer, list[tuple[str, nn.Module]]]]:
        """Each producer and the linears that consume its output, by path name."""
        a, mlp = self.attn, self.img_mlp
        return {
            "attn_input": (
                self.img_norm1,
                [("attn.to_q", a.to_q), ("attn.to_k", a.to_k), ("attn.to_v", a.to_v)],
            ),
            "mlp_input": (
                self.img_norm2,
                [("img_mlp.gate_layer", mlp.gate_layer), ("img_mlp.proj", mlp.proj)],
            ),
            "mlp_hidden": (mlp, [("img_mlp.out", mlp.out)]),
        }

    def post_load_weights(self, fuse: bool, prefix: str) -> list[PathDecision]:
        """The DESIGN §4 gate for each producer path. Per-token modulation is data the kernels take
        (`ModulationRows`), so it does not refuse fusion here."""
        device = self.attn.norm_q.weight.device  # a plain parameter: linears may be wrapped
        return [
            configure_norm_quant(producer, f"{prefix}{name}", consumers, device, fuse)
            for name, (producer, consumers) in self.producer_paths().items()
        ]


class ZeroCenteredRMSNorm(nn.Module):
    """`txt_in.text_norm`: RMSNorm whose stored weight is `scale - 1`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm_reference(x, self.weight, self.eps)


class TextProjection(nn.Module):
    """`txt_in`: zero-centred RMSNorm, Linear, GELU(tanh), Linear (no biases)."""

    def __init__(self, context_dim: int, dim: int, eps: float) -> None:
        super().__init__()
        self.text_norm = ZeroCenteredRMSNorm(context_dim, eps)
        self.in_layer = nn.Linear(context_dim, dim, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(self.act(self.in_layer(self.text_norm(x))))


class TemporalTimesteps(nn.Module):
    """`[cos, sin]` of `1000 * t` times 128 frequencies (diffusers' `QwenImage21TemporalTimesteps`).

    diffusers keeps the frequencies in a non-persistent FP32 buffer, which its `from_pretrained(dtype=...)`
    leaves in FP32 (only `model.to(dtype)` would round it), so they stay FP32 here, whatever the activation
    dtype (cached per device: no copy per step).
    """

    def __init__(self, channels: int = TIMESTEP_CHANNELS, max_period: int = 10000) -> None:
        super().__init__()
        half = channels // 2
        exponent = -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device="cpu")
        self._freqs = torch.exp(exponent / half)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        if timestep.device not in self._on_device:
            self._on_device[timestep.device] = self._freqs.to(timestep.device)
        args = (1000.0 * timestep.float())[:, None] * self._on_device[timestep.device][None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """`time_text_embed.timestep_embedder`: linear_1 -> SiLU -> linear_2, no biases."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(TIMESTEP_CHANNELS, dim, bias=False)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class TimeEmbed(nn.Module):
    """`time_text_embed`: timestep [R] (already in the activation dtype) -> `temb` [R, D]."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_proj = TemporalTimesteps()
        self.timestep_embedder = TimestepEmbedder(dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(self.time_proj(timestep).to(dtype))


class OutputNorm(nn.Module):
    """`norm_out`: LN then `x * (1 + scale[row])`, scale from `linear(silu(temb))` (no shift in 2.1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, dim, bias=False)
        self.norm = ScaleNorm(eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, rows: ModulationRows) -> torch.Tensor:
        return self.norm(x, self.linear(self.silu(temb).to(x.dtype)), rows)


class QwenImage21Transformer(nn.Module):
    """The Qwen-Image 2.1 DiT; reference numerics reproduce diffusers' `QwenImage21Transformer2DModel`.

    Per request: `layout(...)` once, `new_kv_cache(layout)` when the prefix is cached. Per step: `forward`
    (full pass, and it fills the cache when given one) or `forward_cached` (target rows only). Both return
    the target image's velocity [B, T, out] (diffusers returns every joint row; the pipeline slices them).
    """

    def __init__(self, config: QwenImage21Config) -> None:
        super().__init__()
        self.config = config
        dim, eps = config.inner_dim, config.eps
        self.time_text_embed = TimeEmbed(dim)
        self.txt_in = TextProjection(config.context_in_dim, dim, eps)
        self.img_in = nn.Linear(config.in_channels * config.patch_size**2, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList(
            QwenImage21Block(dim, config.num_attention_heads, config.attention_head_dim, config.mlp_dim, eps)
            for _ in range(config.num_layers)
        )
        self.norm_out = OutputNorm(dim, eps)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.out_channels, bias=False)
        self.quant_config: QuantConfig | None = None
        self._rope_tables = rope_tables(config.axes_dims_rope)

    @property
    def is_fp8(self) -> bool:
        return any(isinstance(m, Fp8Linear) for m in self.modules())

    @property
    def device(self) -> torch.device:
        return self.transformer_blocks[0].attn.norm_q.weight.device

    def set_numerics(self, numerics: Numerics | str) -> None:
        """Reference (diffusers op for op) or contract (DESIGN §4) arithmetic for every producer."""
        set_numerics(self, numerics)

    def post_load_weights(self, fuse: bool | None = None) -> FusionReport:
        """Run once after the weights are in place: FP8 inverse scales, then every block's fusion gate
        (models/blocks.py `gate_blocks`); `fuse=False` or QWEN_IMAGE_FP8_FUSION=0 forces the unfused path."""
        self.fusion_report = gate_blocks(self, fuse, mlp_label="SwiGLU")
        return self.fusion_report

    def layout(
        self,
        img_mask: torch.Tensor,
        img_shapes: list[tuple[int, int, int]],
        text_mask: torch.Tensor | None = None,
    ) -> TokenLayout:
        """A request's token layout on the model's device (diffusers' `img_mask`, `img_shapes[0]` and
        `encoder_hidden_states_mask`); host work, once per request."""
        return build_layout(
            img_mask, img_shapes, text_mask, self._rope_tables, self.config.causal_condition, self.device
        )

    def new_kv_cache(self, layout: TokenLayout, dtype: torch.dtype) -> PrefixKVCache:
        """Empty key/value buffers for every block of one request; needs `causal_condition`."""
        if not self.config.causal_condition:
            raise ValueError(
                "a KV cache needs causal_condition: only then is the prefix the same at every step"
            )
        c = self.config
        shape = (c.num_layers, 2, layout.batch, layout.seq_len, c.num_attention_heads, c.attention_head_dim)
        return PrefixKVCache(layout, torch.empty(shape, dtype=dtype, device=self.device))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        layout: TokenLayout,
        kv_cache: PrefixKVCache | None = None,
    ) -> torch.Tensor:
        """Full pass: packed latents [B, N_img, C] (condition images first, target last), text [B, L, ctx],
        timestep [B] in [0, 1]; block-causal attention over the prefix. With `kv_cache`, its buffers hold this
        pass's keys and values afterwards (diffusers' `kv_cache_mode="extract"`)."""
        batch = layout.batch
        if hidden_states.shape[:2] != (batch, layout.image_len):
            raise ValueError(
                f"latents {list(hidden_states.shape)} do not fit the layout's {layout.image_len} rows"
            )
        if encoder_hidden_states.shape[:2] != (batch, layout.text_len):
            raise ValueError(
                f"text {list(encoder_hidden_states.shape)} does not fit the layout's {layout.text_len}"
            )
        image = self.img_in(hidden_states)
        text = self.txt_in(encoder_hidden_states)
        joint = text.new_empty(batch, layout.seq_len, text.shape[-1])
        joint[:, layout.text_rows] = text[:, layout.text_source]
        joint[:, layout.image_rows] = image
        if kv_cache is None:
            c = self.config
            kv = TransientKV(
                batch, layout.seq_len, c.num_attention_heads, c.attention_head_dim, joint.dtype, joint.device
            )
        else:
            self._check_cache(kv_cache, layout)
            kv = kv_cache
        out = self._run(joint, timestep, layout.full, kv)
        if kv_cache is not None:
            kv_cache.filled = True
        return out

    def forward_cached(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        layout: TokenLayout,
        kv_cache: PrefixKVCache,
        plan: PassPlan | None = None,
    ) -> torch.Tensor:
        """Target-only step (diffusers' `kv_cache_mode="cached"`): target latents [B, T, C] attend to the
        prefix keys/values the full pass left in `kv_cache`. No host syncs, no per-step buffers. `plan`
        (default `layout.target`) is the same pass over other tensors holding the same values, e.g. a CUDA
        graph's static copies of the RoPE rows and key mask (`layout.target_pass`)."""
        self._check_cache(kv_cache, layout)
        if not kv_cache.filled:
            raise RuntimeError("the KV cache is empty: run the full pass (forward with kv_cache) first")
        if hidden_states.shape[:2] != (layout.batch, layout.target_len):
            raise ValueError(
                f"target latents {list(hidden_states.shape)} do not fit {layout.target_len} rows"
            )
        plan = layout.target if plan is None else plan
        return self._run(self.img_in(hidden_states), timestep, plan, kv_cache)

    def _check_cache(self, kv_cache: PrefixKVCache, layout: TokenLayout) -> None:
        if kv_cache.layout is not layout:
            raise ValueError("the KV cache belongs to another layout (one cache per request and CFG branch)")

    def _run(
        self, x: torch.Tensor, timestep: torch.Tensor, plan: PassPlan, kv: TransientKV | PrefixKVCache
    ) -> torch.Tensor:
        """Modulation, the blocks and the output layer over the pass's rows; returns the target rows."""
        timestep = timestep.to(x.dtype)
        if self.config.causal_condition:  # an extra t = 0 row: the prefix modulates from it
            timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        temb = self.time_text_embed(timestep, x.dtype)
        scale1, gate1, scale2, gate2 = self.modulation(temb).chunk(4, dim=-1)
        mod = Modulation(scale1, TanhGate.of(gate1), scale2, TanhGate.of(gate2))
        blocks = self.transformer_blocks
        (x,) = run_blocks(len(blocks), (x,), lambda i, s: (blocks[i](s[0], mod, plan, kv.layer(i)),))
        target = x[:, plan.output_start :].contiguous()
        return self.proj_out(self.norm_out(target, temb, plan.output_rows))
