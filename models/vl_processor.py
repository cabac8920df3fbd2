"""Vision-language processors (transformers' Qwen2-VL and Qwen3-VL ones) from a checkpoint's `processor/`
folder, with or without torchvision.

In transformers 5 these processors' default image backend is torchvision's, and their constructor checks a
video processor that needs torchvision too; our CPU install has no torchvision (its wheels pull a CUDA torch).
Where it is missing, the same folder's image processor is built with the PIL backend
(`Qwen2VLImageProcessorPil`, which both Qwen2-VL and Qwen3-VL use) and the processor without a video
processor: images and text go through the parent class's own `__call__`, unchanged. Whether the two backends
give the same `pixel_values` is measured on a machine with both (tests/gpu).
"""

import functools
import importlib.util
from pathlib import Path

from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from qwen_image_fusion.models.errors import CheckpointError

BACKENDS = ("auto", "pil", "torchvision")


def torchvision_available() -> bool:
    return importlib.util.find_spec("torchvision") is not None


@functools.cache
def without_video(processor_class: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """`processor_class` that may be built without a video processor (images and text only)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: object) -> type:
        if argument_name == "video_processor" and argument is None:
            return type(None)
        return processor_class.check_argument_for_proper_class(self, argument_name, argument)

    return type(
        processor_class.__name__,
        (processor_class,),
        {"check_argument_for_proper_class": check_argument_for_proper_class, "__module__": __name__},
    )


def load_vl_processor(
    directory: Path, processor_class: type[ProcessorMixin], backend: str = "auto"
) -> ProcessorMixin:
    """`processor_class` from `directory`. Backend "torchvision": transformers' own `from_pretrained`
    (torchvision image processor); "pil": the folder's image processor with the PIL backend, its tokenizer
    and chat template; "auto": torchvision where it is installed, else PIL."""
    if backend not in BACKENDS:
        raise ValueError(f"processor backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not (directory / "preprocessor_config.json").is_file():
        raise CheckpointError(f"processor folder {directory} has no preprocessor_config.json")
    if backend == "auto":
        backend = "torchvision" if torchvision_available() else "pil"
    try:
        if backend == "torchvision":
            return processor_class.from_pretrained(directory, local_files_only=True)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        settings, _ = processor_class.get_processor_dict(directory, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError... for a bad folder
        raise CheckpointError(f"processor in {directory} cannot be loaded: {exc}".splitlines()[0]) from exc
    return without_video(processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=settings.get("chat_template")
    )
