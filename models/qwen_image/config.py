"""Qwen-Image's configs, torch-free: the transformer fields of diffusers' `transformer/config.json` that shape
the model, the VAE geometry, and the checks that the components of a checkpoint fit together."""

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.errors import CheckpointError

PIPELINE_CLASS = "QwenImagePipeline"  # model_index.json `_class_name` of a text-to-image checkpoint
CONTROLNET_PIPELINE_CLASS = "QwenImageControlNetPipeline"  # the same with a `controlnet/` folder
CONTROLNET_INPAINT_PIPELINE_CLASS = "QwenImageControlNetInpaintPipeline"  # ... an inpainting ControlNet
LAYERED_PIPELINE_CLASS = "QwenImageLayeredPipeline"  # Qwen-Image-Layered: an image into RGBA layers
DEFAULT_VAE_DOWNSAMPLE = (False, True, True)  # AutoencoderKLQwenImage's default temperal_downsample
DEFAULT_VAE_Z_DIM = 16

UNSUPPORTED_FLAGS = ("guidance_embeds",)
LAYERED_FLAGS = ("use_additional_t_cond", "use_layer3d_rope")  # Qwen-Image-Layered's transformer


@dataclass(frozen=True)
class QwenImageConfig:
    """Qwen-Image MMDiT hyper-parameters; defaults are the public 20B checkpoint (DESIGN §1)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    zero_cond_t: bool = False  # Edit-2511: reference-image tokens modulated from t = 0
    use_additional_t_cond: bool = False  # Layered: a learned task embedding (row 0: RGBA layers) in temb
    use_layer3d_rope: bool = False  # Layered: a frame index per layer, the condition image at frame -1
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.attention_head_dim != sum(self.axes_dims_rope):
            raise ValueError(
                f"attention_head_dim {self.attention_head_dim} must equal sum(axes_dims_rope) "
                f"{sum(self.axes_dims_rope)}"
            )
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must be even")
        if self.in_channels != self.out_channels * self.patch_size**2:
            raise ValueError(
                f"in_channels {self.in_channels} must be out_channels*patch_size^2 "
                f"({self.out_channels * self.patch_size**2})"
            )
        if min(self.num_layers, self.num_attention_heads, self.joint_attention_dim) < 1:
            raise ValueError("num_layers, num_attention_heads and joint_attention_dim must be positive")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def layered(self) -> bool:
        """It carries one of Qwen-Image-Layered's transformer flags."""
        return self.use_additional_t_cond or self.use_layer3d_rope

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "QwenImageConfig":
        """Build from a diffusers config dict; refuses guidance embeddings, which no Qwen-Image checkpoint
        has (diffusers keeps the flag for a distilled variant)."""
        enabled = [flag for flag in UNSUPPORTED_FLAGS if raw.get(flag)]
        if enabled:
            raise CheckpointError(
                f"transformer config enables {', '.join(enabled)}: only the Qwen-Image, Qwen-Image-Edit and "
                "Qwen-Image-Layered architectures are supported"
            )
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        if "axes_dims_rope" in known:
            known["axes_dims_rope"] = tuple(known["axes_dims_rope"])
        if known.get("out_channels") is None:
            known.pop("out_channels", None)
        try:
            return cls(**known, extra={k: v for k, v in raw.items() if k not in names})
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"invalid transformer config: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """diffusers-compatible config.json content."""
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out["axes_dims_rope"] = list(self.axes_dims_rope)
        out["guidance_embeds"] = False
        out["_class_name"] = "QwenImageTransformer2DModel"
        return {**self.extra, **out}


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """Pixels per latent cell along a side: `2 ** len(temperal_downsample)`, as diffusers reads it."""
    return 2 ** len(vae_config.get("temperal_downsample", DEFAULT_VAE_DOWNSAMPLE))


def check_compatible(transformer: QwenImageConfig, vae: dict[str, Any], text_hidden: int) -> None:
    """Refuse components that cannot run together, naming both disagreeing values."""
    z_dim = vae.get("z_dim", DEFAULT_VAE_Z_DIM)
    problems = []
    if transformer.patch_size != 2:
        problems.append(f"transformer patch_size is {transformer.patch_size}, the pipeline packs latents 2x2")
    if transformer.in_channels != 4 * z_dim:
        problems.append(
            f"transformer in_channels {transformer.in_channels} needs a VAE z_dim of "
            f"{transformer.in_channels / 4:g} (2x2 packed), but the VAE's z_dim is {z_dim}"
        )
    if transformer.out_channels != z_dim:
        problems.append(
            f"transformer out_channels {transformer.out_channels} differs from the VAE's z_dim {z_dim}"
        )
    for key in ("latents_mean", "latents_std"):
        values = vae.get(key)
        if values is None or len(values) != z_dim:
            problems.append(f"VAE {key} has {0 if values is None else len(values)} values for z_dim {z_dim}")
    if transformer.joint_attention_dim != text_hidden:
        problems.append(
            f"transformer joint_attention_dim {transformer.joint_attention_dim} differs from the text "
            f"encoder's hidden_size {text_hidden}"
        )
    if problems:
        raise CheckpointError(f"components do not fit together: {problems[0]}")


@dataclass(frozen=True)
class CheckpointConfigs:
    """The configs of a Qwen-Image checkpoint that the pipeline needs before loading it."""

    transformer: QwenImageConfig
    vae: dict[str, Any]
    text_hidden: int

    @property
    def vae_scale_factor(self) -> int:
        return vae_scale_factor(self.vae)


def read_configs(directory: Path) -> CheckpointConfigs:
    """Read and compare the component configs before any weight is read, so a misfit fails in a second."""
    transformer = QwenImageConfig.from_dict(read_json(directory / "transformer" / "config.json"))
    vae = read_json(directory / "vae" / "config.json")
    text = read_json(directory / "text_encoder" / "config.json")
    hidden = text.get("text_config", {}).get("hidden_size", text.get("hidden_size"))
    if not isinstance(hidden, int):
        raise CheckpointError(f"{directory / 'text_encoder' / 'config.json'} has no hidden_size")
    try:
        check_compatible(transformer, vae, hidden)
    except CheckpointError as err:
        raise CheckpointError(f"{directory}: {err}") from err
    return CheckpointConfigs(transformer, vae, hidden)


CONTROLNET_CLASS = "QwenImageControlNetModel"  # a controlnet/ folder's diffusers class
CONTROLNET_KEYS = (
    "patch_size",
    "in_channels",
    "out_channels",
    "num_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "axes_dims_rope",
)


@dataclass(frozen=True)
class ControlNetConfig:
    """The ControlNet's shape: Qwen-Image's block hyper-parameters and the extra channels of its control
    input (0 for the Union ControlNet; the inpainting ControlNet adds the mask's)."""

    blocks: QwenImageConfig
    extra_condition_channels: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ControlNetConfig":
        """From a diffusers `controlnet/config.json`; CheckpointError for another class or a bad shape."""
        if raw.get("_class_name", CONTROLNET_CLASS) != CONTROLNET_CLASS:
            raise CheckpointError(
                f"controlnet config is a {raw.get('_class_name')}, not a {CONTROLNET_CLASS}"
            )
        extra = raw.get("extra_condition_channels", 0)
        if not isinstance(extra, int) or extra < 0:
            raise CheckpointError(f"controlnet extra_condition_channels {extra!r} must be an integer >= 0")
        blocks = QwenImageConfig.from_dict({k: raw[k] for k in CONTROLNET_KEYS if k in raw})
        return cls(blocks, extra)

    @property
    def inpaints(self) -> bool:
        """An inpainting ControlNet: its input also carries the mask (packed 2x2, one channel per cell)."""
        return self.extra_condition_channels > 0

    @property
    def pipeline_class(self) -> str:
        """The diffusers pipeline of a checkpoint holding this ControlNet."""
        return CONTROLNET_INPAINT_PIPELINE_CLASS if self.inpaints else CONTROLNET_PIPELINE_CLASS

    def to_dict(self) -> dict[str, Any]:
        """diffusers-compatible config.json content."""
        blocks = {k: v for k, v in self.blocks.to_dict().items() if k in CONTROLNET_KEYS}
        return {
            **blocks,
            "extra_condition_channels": self.extra_condition_channels,
            "_class_name": CONTROLNET_CLASS,
        }
