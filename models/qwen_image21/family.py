"""The Qwen-Image 2.1 family (text to image, and images conditioned on up to four condition images): its
checkpoints read without torch, loaded into `QwenImage21Model`. The Turbo checkpoint is the same pipeline
class with `sample_sigmas` in its model_index.json."""

from pathlib import Path

from qwen_image_fusion.models.checkpoint import WeightFormat, transformer_weights
from qwen_image_fusion.models.family import CheckpointSpec, FamilyModel, GenerationDefaults, ModelFamily
from qwen_image_fusion.models.qwen_image.family import QwenImageFamily
from qwen_image_fusion.models.qwen_image21.checkpoint import (
    MAX_CONDITION_IMAGES,
    PIPELINE_CLASS,
    SIZE_MULTIPLE,
    read_configs21,
)


class QwenImage21Family(ModelFamily):
    name = "qwen-image-2.1"
    pipeline_classes = (PIPELINE_CLASS,)

    def inspect(self, directory: Path, name: str) -> CheckpointSpec:
        configs = read_configs21(directory)
        weights = transformer_weights(directory / "transformer")
        heads = configs.transformer.num_attention_heads
        return self._spec(directory, name, heads, configs.defaults, weights)

    def load(self, spec: CheckpointSpec, dtype, device, vae_dtype) -> FamilyModel:
        from qwen_image_fusion.models.qwen_image21.model import QwenImage21Model

        sigmas = read_configs21(spec.directory).sample_sigmas
        return QwenImage21Model.load(spec.directory, dtype, device, vae_dtype, sigmas)

    def spec_for(self, model: FamilyModel, name: str, defaults: GenerationDefaults) -> CheckpointSpec:
        from qwen_image_fusion.models.modelopt import weight_format

        heads = model.transformer.config.num_attention_heads
        return self._spec(Path(name), name, heads, defaults, weight_format(model.transformer))

    def _spec(
        self, directory: Path, name: str, heads: int, defaults: GenerationDefaults, weights: WeightFormat
    ) -> CheckpointSpec:
        """2.1's spec: 32-pixel sides, up to 4 condition images, no sequence-parallel plan."""
        return CheckpointSpec(
            family=self,
            directory=directory,
            name=name,
            attention_heads=heads,
            size_multiple=SIZE_MULTIPLE,
            defaults=defaults,
            weights=weights,
            max_images=MAX_CONDITION_IMAGES,
            sequence_parallel=False,
        )

    def memory_profile(self, spec: CheckpointSpec, dtype_bytes: int, vae_dtype_bytes: int):
        from qwen_image_fusion.models.qwen_image21.memory import memory_profile

        return memory_profile(spec.directory, dtype_bytes, vae_dtype_bytes)

    def meta_transformer(self, spec: CheckpointSpec):
        from qwen_image_fusion.models.loading import meta_transformer
        from qwen_image_fusion.models.qwen_image21.loading import build_transformer21

        return meta_transformer(spec.directory / "transformer", build_transformer21)

    # diffusers' `QwenImage21Pipeline` reads LoRA files with Qwen-Image's loader mixin
    convert_lora = QwenImageFamily.convert_lora


FAMILY = QwenImage21Family()
