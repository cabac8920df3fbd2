"""The Qwen-Image text-to-image family: its checkpoints read without torch, loaded into `QwenImageModel`."""

from pathlib import Path

from qwen_image_fusion.models.checkpoint import check_layout, read_model_index, transformer_weights
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.family import (
    DEFAULTS_KEY,
    CheckpointSpec,
    FamilyModel,
    GenerationDefaults,
    ModelFamily,
)
from qwen_image_fusion.models.qwen_image.config import (
    LAYERED_FLAGS,
    PIPELINE_CLASS,
    QwenImageConfig,
    read_configs,
)
from qwen_image_fusion.models.qwen_image.presets import LIGHTNING_PRESETS

COMPONENT_DIRS = ("transformer", "text_encoder", "tokenizer", "vae", "scheduler")
DEFAULT_SAMPLE_SIZE = 128  # latent cells per side by default, as diffusers' pipeline (1024 px at 8x)


class QwenImageFamily(ModelFamily):
    name = "qwen-image"
    pipeline_classes = (PIPELINE_CLASS,)
    component_dirs = COMPONENT_DIRS
    presets = LIGHTNING_PRESETS

    def inspect(self, directory: Path, name: str) -> CheckpointSpec:
        index = read_model_index(directory)
        builtin_tokenizer = index.get("_builtin_tokenizer") is not None
        check_layout(
            directory, tuple(d for d in self.component_dirs if not (builtin_tokenizer and d == "tokenizer"))
        )
        configs = read_configs(directory)
        self.check_architecture(configs.transformer, directory, index.get("_class_name"))
        multiple = 2 * configs.vae_scale_factor  # one latent cell per side after 2x2 packing
        side = DEFAULT_SAMPLE_SIZE * configs.vae_scale_factor
        defaults = GenerationDefaults(width=side, height=side).with_metadata(
            index.get(DEFAULTS_KEY), directory / "model_index.json"
        )
        if defaults.width % multiple or defaults.height % multiple:
            raise CheckpointError(
                f"{directory / 'model_index.json'}: default size {defaults.width}x{defaults.height} is not a "
                f"multiple of {multiple}"
            )
        return CheckpointSpec(
            family=self,
            directory=directory,
            name=name,
            attention_heads=configs.transformer.num_attention_heads,
            size_multiple=multiple,
            defaults=defaults,
            weights=transformer_weights(directory / "transformer"),
            starts_from_image=True,
            shares_text_encoding=True,
            fast_decode=True,
        )

    def check_architecture(self, transformer: QwenImageConfig, directory: Path, pipeline_class: str) -> None:
        """Refuse a transformer made for Qwen-Image-Layered under another pipeline class: diffusers' other
        Qwen-Image pipelines pass it no layer conditioning."""
        flags = [flag for flag in LAYERED_FLAGS if getattr(transformer, flag)]
        if flags:
            raise CheckpointError(
                f"{directory / 'transformer' / 'config.json'}: {', '.join(flags)} is Qwen-Image-Layered's "
                f"transformer, but model_index.json names {pipeline_class}"
            )

    def load(self, spec: CheckpointSpec, dtype, device, vae_dtype) -> FamilyModel:
        from qwen_image_fusion.models.qwen_image.model import QwenImageModel

        return QwenImageModel.load(spec.directory, dtype, device, vae_dtype)

    def spec_for(self, model: FamilyModel, name: str, defaults: GenerationDefaults) -> CheckpointSpec:
        from qwen_image_fusion.models.modelopt import weight_format

        return CheckpointSpec(
            family=self,
            directory=Path(name),
            name=name,
            attention_heads=model.transformer.config.num_attention_heads,
            size_multiple=2 * model.vae_scale_factor,
            defaults=defaults,
            weights=weight_format(model.transformer),
            starts_from_image=True,
            shares_text_encoding=True,
            fast_decode=True,
        )

    def meta_transformer(self, spec: CheckpointSpec):
        from qwen_image_fusion.models.loading import meta_transformer
        from qwen_image_fusion.models.qwen_image.components import build_transformer

        return meta_transformer(spec.directory / "transformer", build_transformer)

    def memory_profile(self, spec: CheckpointSpec, dtype_bytes: int, vae_dtype_bytes: int):
        from qwen_image_fusion.models.qwen_image.memory import memory_profile

        return memory_profile(spec.directory, dtype_bytes, vae_dtype_bytes)

    def convert_lora(self, state):
        from diffusers.loaders.lora_pipeline import QwenImageLoraLoaderMixin

        return QwenImageLoraLoaderMixin.lora_state_dict(state)


FAMILY = QwenImageFamily()
