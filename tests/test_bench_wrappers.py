"""The bench scripts' wrappers around pipeline stages keep up with the stages' signatures (a refactor of the
decode stage once broke bench/memory_bench.py's, seen only on the GPU)."""

import hashlib

from bench.memory_bench import latents_sha
from qwen_image_fusion.pipelines.loading import load_pipeline


def test_memory_bench_records_the_latents_each_decode_gets_with_either_decode() -> None:
    pipe = load_pipeline(None, variant="reference", device="cpu", dtype="fp32")
    given = []
    decode = pipe.model.decode

    def keep(latents, *args, **kwargs):  # below the recorder: what the stage really passed on
        given.append(hashlib.sha256(latents.float().cpu().numpy().tobytes()).hexdigest())
        return decode(latents, *args, **kwargs)

    pipe.model.decode = keep
    seen = latents_sha(pipe)  # the recorder on top, as memory_bench installs it
    for fast in (False, True):
        image = pipe.generate(
            "a red circle", num_inference_steps=2, width=64, height=64, seed=0, fast_decode=fast
        )
        assert image is not None and seen["last"] == given[-1]
    assert len(given) == 2 and given[0] == given[1]  # the same seed's latents, decoded both ways
