"""What a model family tells the GPU-memory planner, read without torch: the bytes of each component as it
will sit on the device (from the safetensors headers and the load dtypes, no weight read), split into what
may leave the device, and the activations a request needs in each phase.

Only tensors of two or more dimensions (weight matrices, embeddings, LoRA factors) ever leave the device;
norms, biases and scales stay (a few hundred KB per block), so the fusion gate and FP8 scales always see
the device. A component's blocks (the transformer's `transformer_blocks.N`, the text encoder's
`layers.N`) are what streaming moves one at a time; the rest of its moving tensors is its `fixed` part.
"""

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from qwen_image_fusion.models.checkpoint import MODELOPT_SCALE_SUFFIXES, weight_files
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.family import MAX_SEQUENCE_LENGTH

ENCODE, DENOISE, DECODE = "encode", "denoise", "decode"
PHASES = (ENCODE, DENOISE, DECODE)
SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
MAX_HEADER = 100 * 1024**2  # safetensors' own limit on the JSON header
STORED = ("F8_E4M3", "U8")  # quantized weights (FP8, packed NVFP4 codes) load as stored


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor as its header describes it."""

    name: str
    dtype: str  # safetensors dtype name ("BF16", "F8_E4M3", ...)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for side in self.shape:
            count *= side
        return count


def read_header(path: Path) -> list[TensorInfo]:
    """The tensors of one safetensors file, from its JSON header only (no weight is read)."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER:
                raise CheckpointError(f"{path}: safetensors header of {length} bytes is not plausible")
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read the safetensors header of {path}: {err}") from err
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_BYTES:
            raise CheckpointError(f"{path}: tensor {name} has an unknown dtype in the header")
        tensors.append(TensorInfo(name, entry["dtype"], tuple(entry.get("shape", ()))))
    return tensors


def loaded_bytes(tensor: TensorInfo, dtype_bytes: int) -> int:
    """Bytes per element of a transformer tensor once loaded (models/loading.py's casts): quantized weights
    (E4M3, packed E2M1) and ModelOpt scales as stored, everything else in the model's dtype."""
    if tensor.dtype in STORED or tensor.name.endswith(MODELOPT_SCALE_SUFFIXES):
        return SAFETENSORS_BYTES[tensor.dtype]
    return dtype_bytes


def component_tensors(directory: Path) -> list[TensorInfo]:
    """Every tensor of a component directory (all its shards), from the headers."""
    return [t for path in weight_files(directory) for t in read_header(path)]


@dataclass(frozen=True)
class PartSizes:
    """A component as it sits on the device, in bytes: what always stays (`small`: tensors below two
    dimensions), what may leave (`fixed`: its other moving tensors; `blocks`: each block's), when it runs
    (`phase`) and whether its calls are captured in CUDA graphs (then streamed blocks need fixed buffers)."""

    name: str  # the component (a field of the family's components: text_encoder, transformer, vae)
    phase: str  # ENCODE, DENOISE or DECODE
    small: int
    fixed: int
    blocks: tuple[int, ...]
    block_path: str | None = None  # module path of its block list, e.g. "transformer_blocks"
    graphed: bool = False

    @property
    def total(self) -> int:
        return self.small + self.fixed + sum(self.blocks)


def part_sizes(
    name: str,
    phase: str,
    tensors: list[TensorInfo],
    bytes_per_element: Callable[[TensorInfo], int],
    block_key: str | None = None,
    block_path: str | None = None,
    graphed: bool = False,
) -> PartSizes:
    """Sizes of a component from its tensors: `bytes_per_element` gives each tensor's element size once
    loaded (the load casts), `block_key` a regex whose first group is the block index in a tensor name."""
    pattern = None if block_key is None else re.compile(block_key)
    small = fixed = 0
    blocks: dict[int, int] = {}
    for tensor in tensors:
        size = tensor.numel * bytes_per_element(tensor)
        if len(tensor.shape) < 2:
            small += size
            continue
        match = None if pattern is None else pattern.search(tensor.name)
        if match is None:
            fixed += size
        else:
            index = int(match.group(1))
            blocks[index] = blocks.get(index, 0) + size
    if blocks and sorted(blocks) != list(range(len(blocks))):
        raise CheckpointError(f"{name}: block indices {sorted(blocks)[:5]}... are not 0..{len(blocks) - 1}")
    return PartSizes(
        name, phase, small, fixed, tuple(blocks[i] for i in range(len(blocks))), block_path, graphed
    )


@dataclass(frozen=True)
class Workload:
    """The largest request a memory plan must hold: the image size, images per transformer call (prompts
    x images per prompt), prompts per text-encoder call, text tokens per prompt, true CFG (two
    transformer calls per step, and a captured graph for each branch), the input images a request
    carries (edits, condition images: each at the size its family gives it) and the images decoded at
    once (`decode_images`, None: all of them; a batch of requests decodes each request alone), and
    whether its steps run through a step cache (whose buffers stay on the device like a graph's pool) and
    whether it starts from an image (img2img, inpainting: encoded at the output size)."""

    width: int
    height: int
    images: int = 1
    prompts: int = 1
    text_tokens: int = MAX_SEQUENCE_LENGTH
    true_cfg: bool = True
    input_images: int = 0
    decode_images: int | None = None
    step_cache: bool = False
    start_image: bool = False

    @property
    def decoded(self) -> int:
        """Images the VAE decodes at once."""
        return self.images if self.decode_images is None else self.decode_images

    def describe(self) -> str:
        images = f"{self.images} image{'s' if self.images > 1 else ''}"
        cfg = "true CFG" if self.true_cfg else "CFG off"
        plural = "s" if self.input_images > 1 else ""
        inputs = f"{self.input_images} input image{plural}, " if self.input_images else ""
        cache = ", step cache" if self.step_cache else ""
        tokens = f"up to {self.text_tokens} text tokens"
        return f"{self.width}x{self.height}, {images}, {inputs}{cfg}{cache}, {tokens}"


class ActivationModel(Protocol):
    """Device bytes a request needs besides the weights, per phase (a family's estimate for its model)."""

    def encode(self, workload: Workload) -> int:
        """Peak of one text-encoder call over the request's prompts."""

    def step(self, workload: Workload) -> int:
        """Peak of one transformer call (one CFG branch), which a captured CUDA graph keeps as its pool."""

    def first_step(self, workload: Workload) -> int:
        """Peak of a branch's first transformer call, run eagerly before any graph replays (e.g. a full
        pass that fills a KV cache the captured steps read)."""

    def decode(self, workload: Workload, tiled: bool) -> int:
        """Peak of decoding the request's images, whole or in tiles."""

    def held(self, workload: Workload) -> int:
        """Buffers the steps keep from one request to the next (a KV cache per CFG branch), like the
        captured graphs' pools: on the device in every phase."""

    def step_cache(self, workload: Workload) -> int:
        """A step cache's buffers for one CFG branch (models/step_cache.py), kept like `held`, with the
        temporaries its decision adds to a call."""


@dataclass(frozen=True)
class MemoryProfile:
    """A checkpoint's components by phase and its activation estimate: all the planner needs."""

    parts: tuple[PartSizes, ...]
    activations: ActivationModel

    def part(self, phase: str) -> PartSizes:
        """The component that runs in `phase`."""
        for part in self.parts:
            if part.phase == phase:
                return part
        raise CheckpointError(f"no component runs in the {phase} phase")
