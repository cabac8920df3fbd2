"""How many requests share a batch of denoising steps (`Pipeline.run` runs them, docs/DESIGN.md §10).

Requests batch together when their `GenerationRequest.batch_key`s are equal (everything but prompt,
negative prompt and seed). Kernels may compute a row differently at another row count: on a CPU an FP32
linear over one row takes another path (GEMV) than over two, and cuBLAS picks kernels by shape. So a batch
always runs at the fixed number of requests its settings allow (`BatchPlan.slots`), the empty slots filled
with copies of the first request: a request served alone runs the same shapes as in a full batch, so its
bytes are the same whichever batch and slot it lands in. The cost: a request alone computes the whole batch.
A batch's prompts are encoded the same way where the family can: calls of `slots` rows at a token count
from each prompt's own length (`FamilyModel.encode_batch`).
"""

from dataclasses import dataclass

import torch

from qwen_image_fusion.pipelines.generation_request import GenerationRequest

# Estimated device memory one image row of a denoising step needs per megapixel (activations of a
# Qwen-Image-sized DiT in BF16 plus a captured CUDA graph's pool); bench/server_load.py prints the peak.
STEP_BYTES_PER_MEGAPIXEL = 2 * 2**30


@dataclass(frozen=True)
class BatchPlan:
    """How many requests a batch holds: at most `max_images` image rows per step, and within
    `memory_bytes` (None: no bound here; a memory plan checks each batch) at STEP_BYTES_PER_MEGAPIXEL."""

    max_images: int = 1
    memory_bytes: int | None = None

    def slots(self, request: GenerationRequest) -> int:
        """Requests per batch like `request`: the same for every batch of its key (fixed shapes)."""
        rows = self.max_images
        if self.memory_bytes is not None:
            megapixels = request.width * request.height / 1e6
            rows = min(rows, int(self.memory_bytes // (megapixels * STEP_BYTES_PER_MEGAPIXEL)))
        return max(1, rows // request.num_images_per_prompt)

    @classmethod
    def for_device(
        cls, device: torch.device, max_images: int, planned: bool, share: float = 0.8
    ) -> "BatchPlan":
        """`max_images` rows, bounded on CUDA by `share` of the memory free now (after loading), unless a
        memory plan holds the batches (`planned`: made for `max_images` rows of the largest request)."""
        if device.type != "cuda" or planned:
            return cls(max_images)
        free, _ = torch.cuda.mem_get_info(device)
        return cls(max_images, int(free * share))
