"""The Qwen-Image 2.1 family (text to image, and images conditioned on up to four condition images): its
checkpoints read without torch, loaded into `QwenImage21Model`. The Turbo checkpoint is the same pipeline
class with `sample_sigmas` in its model_index.json."""

from pathlib import Path

from models.checkpoint import is_fp8_transformer, read_json
from models.family import CheckpointSpec, FamilyModel, GenerationDefaults, ModelFamily
from models.qwen_image21.checkpoint import (
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
        return CheckpointSpec(
            family=self,
            directory=directory,
            name=name,
            attention_heads=configs.transformer.num_attention_heads,
            size_multiple=SIZE_MULTIPLE,
            defaults=configs.defaults,
            fp8=is_fp8_transformer(directory / "transformer"),
            max_images=MAX_CONDITION_IMAGES,
            sequence_parallel=False,
        )

    def load(self, spec: CheckpointSpec, dtype, device, vae_dtype) -> FamilyModel:
        from models.qwen_image21.model import QwenImage21Model

        sigmas = read_configs21(spec.directory).sample_sigmas
        return QwenImage21Model.load(spec.directory, dtype, device, vae_dtype, sigmas)

    def spec_for(self, model: FamilyModel, name: str, defaults: GenerationDefaults) -> CheckpointSpec:
        return CheckpointSpec(
            family=self,
            directory=Path(name),
            name=name,
            attention_heads=model.transformer.config.num_attention_heads,
            size_multiple=SIZE_MULTIPLE,
            defaults=defaults,
            fp8=model.transformer.is_fp8,
            max_images=MAX_CONDITION_IMAGES,
            sequence_parallel=False,
        )

    def meta_transformer(self, spec: CheckpointSpec):
        import torch

        from models.qwen_image21.loading import build_transformer21

        with torch.device("meta"):
            return build_transformer21(read_json(spec.directory / "transformer" / "config.json"))

    def convert_lora(self, state):
        """diffusers' `QwenImage21Pipeline` reads LoRA files with Qwen-Image's loader mixin."""
        from diffusers.loaders.lora_pipeline import QwenImageLoraLoaderMixin

        return QwenImageLoraLoaderMixin.lora_state_dict(state)


FAMILY = QwenImage21Family()
