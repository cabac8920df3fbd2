"""Shared test helpers: a host-synchronisation guard, PNG hashing, the checkout's root, where chromium is,
ranks for the parallel tests, deterministic random weights for models the tests build, waiting on a
condition, and this process's resident memory."""

import hashlib
import io
import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import PIL.Image
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_image_fusion.models.qwen_image.math import ImageLayout

CPU = torch.device("cpu")
CHROMIUM = Path("/usr/bin/chromium")  # Debian's chromium, driven by Playwright in the `browser` tests
# The checkout under test: subprocesses run from it, so they import its code, not an installed copy.
REPO = Path(__file__).resolve().parents[1]


def tracked(*patterns: str) -> list[Path]:
    """The checkout's files git tracks (all, or those matching `patterns`), as they are on disk."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *patterns], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    return [REPO / name for name in listed.split("\0") if name and (REPO / name).exists()]


class NoHostSync(TorchDispatchMode):
    """Fails on device-to-host scalar reads (`.item()`, `bool(t)`), on tensors made from host data
    (`torch.tensor(...)`), and on host-to-device copies into a model on another device.

    0-dim host scalars that torch passes to device kernels by value (SDPA's mask fill) are not syncs.
    """

    def __init__(self, device: torch.device = CPU) -> None:
        super().__init__()
        self.device = device

    def _host_to_device(self, name: str, args: tuple, kwargs: dict) -> bool:
        if self.device.type == "cpu":
            return False
        if name == "aten::_to_copy":
            return (
                args[0].device.type == "cpu"
                and torch.device(kwargs.get("device", "cpu")).type == self.device.type
            )
        if name == "aten::copy_":
            return args[1].device.type == "cpu" and args[0].device.type == self.device.type
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in ("aten::_local_scalar_dense", "aten::lift_fresh") or self._host_to_device(
            name, args, kwargs
        ):
            raise AssertionError(f"host synchronisation in the denoise step: {name}")
        return func(*args, **kwargs)


def step_without_host_sync(
    model: torch.nn.Module,
    grid: ImageLayout | tuple[int, int, int],
    device: torch.device = CPU,
    text_tokens: int = 5,
    pad_from: int | None = 3,
) -> None:
    """Two transformer steps on a batch of two prompts (the second padded from `pad_from`; None: no mask)
    over the image tokens of `grid` (a layout: target and reference grids): a warm-up that fills the RoPE
    cache as the first step does, then one under NoHostSync, which fails on any host synchronisation."""
    tokens = ImageLayout.of(grid).tokens
    dtype = model.proj_out.weight.dtype  # the activations' dtype (a BF16 linear also in FP8 models)
    latents = torch.randn(2, tokens, model.config.in_channels, dtype=dtype, device=device)
    prompt = torch.randn(2, text_tokens, model.config.joint_attention_dim, dtype=dtype, device=device)
    mask = None
    if pad_from is not None:
        mask = torch.ones(2, text_tokens, dtype=torch.long, device=device)
        mask[1, pad_from:] = 0
    sigma = torch.full((2,), 0.5, device=device)
    with torch.no_grad():
        model(latents, prompt, mask, sigma, grid)
        with NoHostSync(device):
            model(latents, prompt, mask, sigma, grid)


def vocab_and_merges_layout(folder: Path) -> None:
    """Rewrite a byte-level BPE tokenizer that `save_pretrained` wrote to `folder` (tokenizer.json) in the
    layout of Qwen-Image's own tokenizer folder: vocab.json and merges.txt beside tokenizer_config.json, no
    tokenizer.json. transformers builds the same Qwen2Tokenizer from them (its constructor's normalizer and
    pre-tokenizer, the config's special tokens at the same ids) in 0.35 s instead of parsing the 18 MB
    tokenizer.json in 1.2 s, and the tests' tiny checkpoints are loaded some two hundred times a run (each
    Edit, Layered and 2.1 pipeline reads two tokenizer folders). test_checkpoint_configs.py keeps
    tokenizer.json folders (a tokenizer class that needs one among them)."""
    model = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    if model["type"] != "BPE":
        raise ValueError(f"{folder}: a {model['type']} tokenizer, not byte-level BPE")
    merges = [pair if isinstance(pair, str) else " ".join(pair) for pair in model["merges"]]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (folder / "tokenizer.json").unlink()


def png_sha256(image: PIL.Image.Image) -> str:
    """SHA256 of the PNG encoding, as a user comparing files would see it."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return hashlib.sha256(buf.getvalue()).hexdigest()


RANK_SCRIPT = str(REPO / "tests" / "parallel_rank.py")


def repo_env() -> dict[str, str]:
    """The environment of a Python process started by a test: this worktree and its tests importable."""
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    return os.environ | {"PYTHONPATH": os.pathsep.join(paths)}


def rank_env(timeout_s: float = 120) -> dict[str, str]:
    """The environment of ranks started by a test: this worktree importable, one thread each on the CPU,
    a short collective timeout (orphans of a failed test end on their own), NVLink multicast off."""
    return repo_env() | {
        "OMP_NUM_THREADS": "1",
        "QWEN_IMAGE_COLLECTIVE_TIMEOUT": str(timeout_s),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }


def launch(ranks: int, command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `command` as `ranks` ranks through qwen_image_fusion.ui.launch (torch's elastic launcher) in a
    child process; on a timeout the launcher is asked to stop its ranks (SIGTERM), then killed."""
    code = (
        "import sys\nfrom qwen_image_fusion.ui.launch import RanksFailed, launch_ranks\n"
        f"try:\n    launch_ranks({ranks}, {command!r})\n"
        "except RanksFailed as err:\n    print(err)\n    sys.exit(10)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=rank_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        finally:
            proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill_deterministic(module: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from a seeded generator: fan-in scaled weights, small biases, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            parent = name.rsplit(".", 2)[-2] if "." in name else ""
            if "norm" in parent or name.endswith("gamma"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif param.ndim == 1:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            else:
                fan_in = math.prod(param.shape[1:])
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))


def wait_for(condition: Callable[[], object], timeout: float = 10.0) -> float:
    """Poll `condition` every 10 ms until it holds; fails after `timeout` s. Returns the seconds waited."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


def rss_bytes() -> int:
    """Resident set size of this process (server threads and clients included) from /proc."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def diffusers_twin(
    ours: object, pipeline_class: type, state: dict[str, torch.Tensor] | None = None, scheduler: object = None
) -> object:
    """diffusers' `pipeline_class` (a Qwen-Image pipeline) around our text encoder, tokenizer and VAE and
    `scheduler` (default: a copy of ours), with diffusers' own transformer holding `state` (default: our
    transformer's weights): what the oracle reference-mode tests compare with."""
    import copy

    from diffusers import QwenImageTransformer2DModel

    c = ours.components
    config = {k: v for k, v in c.transformer.config.to_dict().items() if not k.startswith("_")}
    transformer = QwenImageTransformer2DModel(**config).to(ours.device, ours.dtype).eval()
    transformer.load_state_dict(c.transformer.state_dict() if state is None else state, strict=True)
    theirs = pipeline_class(
        scheduler=scheduler or copy.deepcopy(c.scheduler),
        vae=c.vae,
        text_encoder=c.text_encoder,
        tokenizer=c.tokenizer,
        transformer=transformer,
    )
    theirs.set_progress_bar_config(disable=True)
    return theirs


def check_served_batches(pipe: Any, prompts: list[str], count: int, again: tuple[int, ...]) -> None:
    """The HTTP server with batching on (4 slots) answers `count` concurrent 128x128 requests (request i:
    prompt i mod len(prompts), seed i) in shared batches, and asking requests `again` alone gives each the
    same PNG bytes."""
    import base64
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from bench.in_thread import InThread
    from qwen_image_fusion.pipelines.batching import BatchPlan
    from qwen_image_fusion.ui.limits import Limits
    from qwen_image_fusion.ui.runner import Runner
    from qwen_image_fusion.ui.server import build_server

    runner = Runner(pipe, Limits.for_device(pipe.device.type), BatchPlan.for_device(pipe.device, 4, False))
    server = InThread(build_server(pipe, runner))

    def ask(i: int) -> bytes:
        body = {"prompt": prompts[i % len(prompts)], "size": "128x128", "seed": i, "num_inference_steps": 4}
        response = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
        return base64.b64decode(response.json()["data"][0]["b64_json"])

    try:
        with ThreadPoolExecutor(count) as pool:
            together = list(pool.map(ask, range(count)))
        assert runner.counters.batch_requests == count and runner.counters.batches < count
        assert [ask(i) for i in again] == [together[i] for i in again]
    finally:
        server.close()
        runner.close()
