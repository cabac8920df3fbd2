"""A loaded Qwen-Image-Edit checkpoint as the family-neutral pipeline drives it.

Each hook follows diffusers' `QwenImageEditPipeline` (one image) or `QwenImageEditPlusPipeline` (up to
three) op for op: the input images prepared and seen by the vision tower in the prompt, their VAE latents
appended after the target's tokens at every step, the transformer's output cut to the target before true
CFG; noise, CFG rescale and decoding are Qwen-Image's own (this class extends `QwenImageModel`). So the
`reference` variant's pixels equal diffusers' on the same weights and images. An Edit checkpoint's inpainting
edit follows `QwenImageEditInpaintPipeline` (diffusers has none for Plus).
"""

from dataclasses import dataclass, replace
from pathlib import Path

import PIL.Image
import torch

from qwen_image_fusion.models.family import Conditioning, Decoded, ImageStart
from qwen_image_fusion.models.mask_crop import MaskCrop
from qwen_image_fusion.models.qwen_image.math import ImageLayout
from qwen_image_fusion.models.qwen_image.model import (
    AppendedImageSteps,
    LatentCanvas,
    QwenImageModel,
    latent_size,
)
from qwen_image_fusion.models.qwen_image_edit.components import EditComponents, load_edit_components
from qwen_image_fusion.models.qwen_image_edit.conditioning import (
    EditImages,
    encode_edit_prompts,
    encode_reference_latents,
    load_edit_image,
    prepare_edit_images,
)
from qwen_image_fusion.models.qwen_image_edit.config import CONDITION_AREA, VAE_AREA, default_output_size


@dataclass(frozen=True)
class EditCanvas:
    """A request's geometry: the target's latent canvas, the packed reference latents of its input images
    ([1, tokens, channels], in image order) and the transformer's layout (target grid, then each image's)."""

    target: LatentCanvas
    references: torch.Tensor
    layout: ImageLayout


class QwenImageEditModel(AppendedImageSteps, QwenImageModel):
    """An Edit checkpoint's components on one device, with the editing hooks of the shared pipeline.

    `vae_area` and `condition_area` are diffusers' fixed image areas (1024x1024 for the VAE, 384x384 for
    Plus's vision tower); tests shrink them, with diffusers' constants, to run in seconds on a CPU."""

    components: EditComponents

    def __init__(self, components: EditComponents, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(components, device, dtype)
        self.kind = components.kind
        self.vae_area, self.condition_area = VAE_AREA, CONDITION_AREA
        self._prepared: tuple[list[PIL.Image.Image], EditImages] | None = None

    @classmethod
    def load(
        cls, directory: Path, dtype: torch.dtype, device: torch.device, vae_dtype: torch.dtype
    ) -> "QwenImageEditModel":
        return cls(load_edit_components(directory, dtype, device, vae_dtype), device, dtype)

    def prepare(self, images: list[PIL.Image.Image]) -> EditImages:
        """The request's images converted as diffusers' `load_image` does (EXIF rotation, RGB) and prepared
        for the vision tower and the VAE. One request asks for them several times (default size, both CFG
        branches, the canvas): the last request's are kept, by the identity of its image objects."""
        if self._prepared is None or not _same_objects(self._prepared[0], images):
            rgb = [load_edit_image(image) for image in images]
            prepared = prepare_edit_images(
                rgb, self.kind, self.vae_scale_factor, self.vae_area, self.condition_area
            )
            self._prepared = (list(images), prepared)
        return self._prepared[1]

    def default_size(self, images: list[PIL.Image.Image]) -> tuple[int, int]:
        """The 1024x1024-area size at the aspect of the first (Edit) or last (Plus) image, EXIF rotation
        applied, floored to the size multiple (diffusers)."""
        return default_output_size(self.kind, self.prepare(images).sizes, 2 * self.vae_scale_factor)

    def encode(
        self, prompts: list[str], max_sequence_length: int, images: list[PIL.Image.Image] | None = None
    ) -> Conditioning:
        """Each prompt with the request's images in its vision slots (Edit: the one image for every prompt;
        Plus: one prompt per call). `max_sequence_length` does not apply: diffusers passes it nowhere."""
        c = self.components
        condition = self.prepare(images or []).condition
        if not self.kind.plus:
            condition = condition * len(prompts)
        embeds, mask = encode_edit_prompts(
            c.text_encoder, c.processor, prompts, condition, self.kind, self.device, self.dtype
        )
        return Conditioning(embeds, mask)

    def canvas(
        self, width: int, height: int, images: list[PIL.Image.Image] | None = None, prompts: int = 1
    ) -> EditCanvas:
        """The target canvas and the input images' VAE latents (encoded in the VAE's dtype, then in the
        model's; diffusers runs both in one dtype). They are encoded whole even when a memory plan decodes
        in tiles (its budget holds a whole encode), so every plan denoises the same latents. Edit's one
        image is encoded once per prompt in one VAE batch, as diffusers' `QwenImageEditPipeline` encodes
        the image list a prompt batch needs there (a convolution may round a row differently at another
        batch size); the rows are equal, and every sample takes the first."""
        vae = self.components.vae
        pixels = self.prepare(images or []).pixels
        if not self.kind.plus and prompts > 1:
            pixels = [torch.cat(pixels * prompts)]
        tiling, vae.use_tiling = vae.use_tiling, False
        try:
            references, grids = encode_reference_latents(vae, pixels, prompts, self.device, vae.dtype)
        finally:
            vae.use_tiling = tiling
        target = latent_size(width, height, self.vae_scale_factor)
        return EditCanvas(target, references[:1].to(self.dtype), ImageLayout(target.grid, grids))

    def initial_latents(self, canvas: EditCanvas, batch: int, seed: int) -> torch.Tensor:
        return super().initial_latents(canvas.target, batch, seed)

    def image_start(
        self,
        image: PIL.Image.Image,
        mask: PIL.Image.Image | None,
        canvas: EditCanvas,
        batch: int,
        seed: int,
        crop: MaskCrop | None = None,
    ) -> ImageStart:
        """An inpainting edit (`QwenImageEditInpaintPipeline`): the input image as the vision tower sees it
        (resized to the output size), VAE-encoded with its latent distribution sampled, then the noise, and
        the mask, as Qwen-Image's inpainting prepares them."""
        if crop is None:
            image = self.prepare([image]).condition[0]
        return super().image_start(image, mask, canvas.target, batch, seed, crop)

    def mask_crop(
        self, image: PIL.Image.Image, mask: PIL.Image.Image, canvas: EditCanvas, pad: int
    ) -> MaskCrop:
        """The box in the input image resized to the output size, where diffusers cuts it and pastes the
        result back (so the edit comes back at the output size). diffusers finds the box in the mask as
        given, and fails unless that is the output size too; the mask is resized here with the image (no
        change when it is already that size)."""
        resized = self.prepare([image]).condition[0]
        mask = self.image_processor.resize(mask, resized.height, resized.width)
        return super().mask_crop(resized, mask, canvas.target, pad)

    def start_canvas(self, canvas: EditCanvas, latents: torch.Tensor) -> EditCanvas:
        """The start latents are the reference latents every step reads (diffusers' inpainting edit feeds
        its sampled `image_latents` to the transformer, not the distribution's mode an edit reads)."""
        return replace(canvas, references=latents)

    def decode(self, latents: torch.Tensor, canvas: EditCanvas, fast: bool = False) -> Decoded:
        return super().decode(latents, canvas.target, fast)

    def describe(self) -> list[str]:
        processor = self.components.processor
        images = (
            "one input image" if self.kind.max_images == 1 else f"1 to {self.kind.max_images} input images"
        )
        return [
            *super().describe(),
            f"processor: {type(processor).__name__} with {type(processor.image_processor).__name__}; "
            f"{self.kind.pipeline_class}: edits with {images}",
        ]


def _same_objects(first: list, second: list) -> bool:
    return len(first) == len(second) and all(a is b for a, b in zip(first, second, strict=True))
