"""Train the embedded default model on drawn scenes: the VAE as an autoencoder, then the DiT by flow matching.

    python -m qwen_image_fusion.training.train_default --out out/train        # the real run (H200, one call)
    python -m qwen_image_fusion.training.train_default --probe --out out/probe  # ~20 s a stage: throughput
    python -m qwen_image_fusion.training.train_default --preset cpu --out out/cpu   # the 64 px CPU de-risk
    python -m qwen_image_fusion.training.train_default --preset smoke --out /tmp/smoke  # seconds (tests)

Stages: (1) render the training scenes (qwen_image_fusion.eval.scenes, held-out object keys excluded) in
worker processes; (2) train `AutoencoderKLQwenImage` on them as a deterministic autoencoder (L1 + MSE, shape
pixels weighted up) and check its reconstructions of the held-out scenes; (3) encode every scene once: VAE
posterior means, normalised with the VAE's latents_mean/std (measured here and written to its config, so the
pipeline's decode inverts exactly this) and packed 2x2 as the pipeline packs them, and both captions (English,
Chinese) through the frozen text encoder with `encode_prompts`, as the pipeline does; (4) train the DiT on
those tensors alone: x_t = (1 - sigma) x0 + sigma noise, target noise - x0, the model gets sigma, sigma = the
scheduler's own time shift (mu of this image size) of a uniform u, so training covers the sampler's shifted
schedule; 10% of captions become the negative prompt " " so true CFG works; (5) generate the held-out captions
with the trained weights through the real pipeline and check them (qwen_image_fusion.eval.meaning). One tar (<
16 MiB) holds the VAE, the DiT (EMA weights, bf16), the loss log, the run's metadata and the held-out samples;
`qwen_image_fusion.training.assemble` turns it into a checkpoint directory.
"""

import argparse
import copy
import json
import math
import mmap
import multiprocessing
import platform
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import PIL
import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
from PIL import Image
from tqdm.auto import tqdm

from qwen_image_fusion.eval.scenes import (
    BACKGROUNDS,
    HELD_OUT_PERCENT,
    LANGUAGES,
    draw_scene,
    held_out_scenes,
    render,
)
from qwen_image_fusion.models.loading import save_transformer
from qwen_image_fusion.models.qwen_image.components import Components, default_scheduler
from qwen_image_fusion.models.qwen_image.family import FAMILY
from qwen_image_fusion.models.qwen_image.math import pack_latents
from qwen_image_fusion.models.qwen_image.model import QwenImageModel
from qwen_image_fusion.models.qwen_image.text_encoder import encode_prompts
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.sampling import shift_mu
from qwen_image_fusion.training.recipe import (
    NEGATIVE_PROMPT,
    RECIPES,
    SAMPLE_CFG_SCALE,
    SAMPLE_STEPS,
    TEXT_ENCODER_SEED,
    Recipe,
    build_text_encoder,
    build_transformer,
    build_vae,
    cast_parameters,
    sampling_defaults,
)

TAR_NAME = "default_model.tar"
MAX_TAR_BYTES = 16 * 1024**2  # the device tool returns files of at most 16 MiB
TEXT_DROPOUT = 0.1
FOREGROUND_WEIGHT = 10.0
EMA_DECAY = 0.999
WARMUP_FRACTION = 0.03
LOG_EVERY = 25  # steps per loss-log row (fewer for short runs: at least 20 rows)
PROBE_WARMUP_STEPS = 3
SAMPLE_BATCH = 100
SAMPLE_SEED = 0


@dataclass(frozen=True)
class Settings:
    """A resolved command line: the preset with the arguments that override it."""

    preset: str
    sizes: Recipe
    seed: int
    device: str
    workers: int
    amp: bool  # bf16 autocast: CUDA only (on CPU, oneDNN's bf16 conv3d crawled and once crashed at 128+ px)
    compile: bool
    vae_from: Path | None  # a previous run's tar whose VAE is reused (the VAE stage is skipped)
    probe_seconds: float | None  # time per stage in --probe mode, else None (fixed step counts)
    out: Path


class LossLog:
    """JSON lines of losses and throughput, kept in memory for the metadata too."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict] = []
        path.write_text("")

    def write(self, row: dict) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steps_of(total: int, seconds: float | None, desc: str) -> Iterator[int]:
    """Step indices 0..total-1 with a progress bar, stopping early after `seconds` when given (probe)."""
    start = time.perf_counter()
    bar = tqdm(range(total), desc=desc, mininterval=2.0, file=sys.stderr)
    for step in bar:
        if seconds is not None and time.perf_counter() - start > seconds:
            bar.close()
            return
        yield step


def log_interval(total: int) -> int:
    return max(1, min(LOG_EVERY, total // 20))


def lr_factor(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    warmup = max(1, int(WARMUP_FRACTION * total))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))


# ---------------------------------------------------------------- stage 1: scenes, rendered in parallel

_PIXELS: np.ndarray | None = None  # the shared output buffer, inherited by forked workers


def render_chunk(task: tuple[int, int, int, int]) -> list[tuple[str, str]]:
    """Render training scenes [start, stop) of stream `seed` into the shared buffer; return their captions."""
    seed, size, start, stop = task
    captions = []
    for index in range(start, stop):
        scene = draw_scene(seed, index)
        _PIXELS[index] = np.asarray(render(scene, size))
        captions.append((scene.captions["en"], scene.captions["zh"]))
    return captions


def render_scenes(seed: int, count: int, size: int, workers: int) -> tuple[np.ndarray, list[str]]:
    """uint8 [count, size, size, 3] images and 2*count captions (scene i: 2i English, 2i+1 Chinese).

    Workers are forked (before CUDA is touched) and write into one anonymous shared mapping.
    """
    global _PIXELS
    shape = (count, size, size, 3)
    _PIXELS = np.frombuffer(mmap.mmap(-1, max(1, math.prod(shape))), np.uint8)[: math.prod(shape)].reshape(
        shape
    )
    chunk = max(1, min(512, math.ceil(count / max(1, 4 * workers))))
    tasks = [(seed, size, start, min(count, start + chunk)) for start in range(0, count, chunk)]
    if workers <= 1:
        results = [render_chunk(task) for task in tqdm(tasks, desc="render", file=sys.stderr)]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = list(
                tqdm(pool.imap(render_chunk, tasks), total=len(tasks), desc="render", file=sys.stderr)
            )
    pixels, _PIXELS = _PIXELS, None
    return pixels, [caption for chunk_captions in results for pair in chunk_captions for caption in pair]


# ---------------------------------------------------------------- stage 2: the VAE


def to_vae_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, 1, H, W] in [-1, 1]."""
    return (images.permute(0, 3, 1, 2).float() / 127.5 - 1.0).unsqueeze(2)


def train_vae(vae, images: torch.Tensor, settings: Settings, log: LossLog) -> dict:
    """A deterministic autoencoder on the posterior means (what `encode_latents` gives the DiT), with L1 +
    MSE weighted FOREGROUND_WEIGHT times on pixels of no background colour; returns throughput.

    Decoding posterior samples instead starved the decoder: the initial unit noise drowned the means,
    and on a CPU run (64 px, 600 steps) the VAE learned the backgrounds and blurred every shape away.
    The weights count the few shape and sign pixels as much as the backgrounds around them."""
    sizes, device = settings.sizes, images.device
    generator = torch.Generator(device).manual_seed(settings.seed + 1)
    backgrounds = torch.tensor(list(BACKGROUNDS.values()), dtype=torch.uint8, device=device)
    vae.to(device).train().requires_grad_(True)
    params = list(vae.parameters())
    run = Optimisation("vae", params, sizes.vae_lr, (0.9, 0.99), sizes.vae_steps, sizes.vae_batch, log)
    for _ in run.steps(settings.probe_seconds):
        batch = images[torch.randint(len(images), (sizes.vae_batch,), device=device, generator=generator)]
        foreground = (batch[:, :, :, None, :] != backgrounds).any(dim=-1).all(dim=-1)
        weight = (1.0 + (FOREGROUND_WEIGHT - 1.0) * foreground.float())[:, None, None]
        x = to_vae_input(batch)
        with torch.autocast(device.type, torch.bfloat16, enabled=settings.amp):
            reconstruction = vae.decode(vae.encode(x).latent_dist.mode()).sample
        error = reconstruction.float() - x
        run.update((weight * (error.abs() + error.square())).mean())
    vae.eval().requires_grad_(False)
    return run.summary()


class Optimisation:
    """What both training stages share: AdamW with warm-up and cosine decay, clipped steps, the running
    loss written to the log every few steps, and throughput."""

    def __init__(
        self,
        stage: str,
        params: list[torch.nn.Parameter],
        lr: float,
        betas: tuple,
        total: int,
        batch: int,
        log: LossLog,
    ) -> None:
        self.stage, self.params, self.lr, self.total, self.log = stage, params, lr, total, log
        device = params[0].device
        self.optimizer = torch.optim.AdamW(
            params, lr=lr, betas=betas, weight_decay=0.0, fused=device.type == "cuda"
        )
        self.running = torch.zeros((), device=device)
        self.every = log_interval(total)
        self.timer = Throughput(device, batch)
        self.last_loss: float | None = None
        self.step = 0

    def steps(self, probe_seconds: float | None) -> Iterator[int]:
        """Step indices with the learning rate set (ending early after `probe_seconds` when given)."""
        for step in steps_of(self.total, probe_seconds, self.stage):
            self.step = step
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr * lr_factor(step, self.total)
            yield step

    def update(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.running += loss.detach()
        self.timer.tick(self.step)
        if (self.step + 1) % self.every == 0:
            self.last_loss = self.running.item() / self.every
            self.log.write(
                {"stage": self.stage, "step": self.step + 1, "loss": self.last_loss, **self.timer.row()}
            )
            self.running.zero_()

    def summary(self) -> dict:
        return self.timer.summary() | {"last_loss": self.last_loss}


class Throughput:
    """Steps/s and images/s after the first PROBE_WARMUP_STEPS (autotuning, allocator warm-up)."""

    def __init__(self, device: torch.device, batch: int) -> None:
        self.device, self.batch = device, batch
        self.start_time = time.perf_counter()
        self.mark_step: int | None = None
        self.mark_time = 0.0
        self.steps = 0

    def tick(self, step: int) -> None:
        self.steps = step + 1
        if step + 1 == PROBE_WARMUP_STEPS:
            synchronize(self.device)
            self.mark_step, self.mark_time = step + 1, time.perf_counter()

    def rate(self) -> float | None:
        if self.mark_step is None or self.steps <= self.mark_step:
            return None
        synchronize(self.device)
        return (self.steps - self.mark_step) / (time.perf_counter() - self.mark_time)

    def row(self) -> dict:
        rate = self.rate()
        return {"seconds": round(time.perf_counter() - self.start_time, 2), "steps_per_s": rate}

    def summary(self) -> dict:
        rate = self.rate()
        return {
            "steps": self.steps,
            "seconds": time.perf_counter() - self.start_time,
            "steps_per_s": rate,
            "images_per_s": None if rate is None else rate * self.batch,
        }


def load_vae_from_tar(tar_path: Path, expected: dict):
    """The trained VAE of an earlier run's tar, in fp32 (its latent statistics are measured again); it
    must have the preset's sizes."""
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(tar_path) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("vae/")]
        if not members:
            raise SystemExit(f"error: {tar_path} holds no vae/: not a train_default output")
        tar.extractall(tmp, members=members, filter="data")
        vae = AutoencoderKLQwenImage.from_pretrained(Path(tmp) / "vae", torch_dtype=torch.float32)
    found = {key: vae.config[key] for key in expected}
    if found != expected:
        raise SystemExit(f"error: the VAE in {tar_path} is {found}, this preset trains {expected}")
    return vae


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor, batch: int, amp: bool) -> torch.Tensor:
    """Posterior means [N, 16, h, w] (fp32) of every image."""
    out = []
    for start in tqdm(range(0, len(images), batch), desc="vae encode", file=sys.stderr):
        x = to_vae_input(images[start : start + batch])
        with torch.autocast(images.device.type, torch.bfloat16, enabled=amp):
            out.append(vae.encode(x).latent_dist.mode()[:, :, 0].float())
    return torch.cat(out)


def normalise_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Measure per-channel mean/std, write them to the VAE config (the pipeline decodes with them), and
    return the model's latents for every image."""
    mean, std = latents.mean(dim=(0, 2, 3)), latents.std(dim=(0, 2, 3))
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    return model_latents(latents, mean, std)


def model_latents(latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """VAE latents [N, 16, h, w] -> what the DiT sees: normalised per channel (the inverse of the pipeline's
    `z = latents * std + mean`) and packed 2x2, [N, h/2 * w/2, 64] in bf16."""
    shape = (1, -1, 1, 1)
    normalised = (latents - mean.view(shape).to(latents)) * (1.0 / std).view(shape).to(latents)
    return pack_latents(normalised).to(torch.bfloat16)


# ---------------------------------------------------------------- stage 3: captions


def contiguous_logit_rows(text_encoder) -> None:
    """`encode_prompts` asks for one logit row per prompt (unused); torch's CPU linear on that strided
    view is ~50x slower in bf16 than on a contiguous copy of the same values, so hand it the copy."""
    text_encoder.lm_head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(),))


@torch.no_grad()
def encode_captions(
    text_encoder, tokenizer, captions: list[str], device: torch.device, batch: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings [M, L, hidden] (bf16, zero-padded to the longest caption) and bool masks [M, L]."""
    rows, lengths = [], []
    for start in tqdm(range(0, len(captions), batch), desc="text encode", file=sys.stderr):
        embeds, mask = encode_prompts(
            text_encoder, tokenizer, captions[start : start + batch], device, torch.bfloat16
        )
        valid = torch.full(embeds.shape[:2], True, device=device) if mask is None else mask.bool()
        rows.append(embeds)
        lengths.append(valid.sum(dim=1))
    longest = max(r.shape[1] for r in rows)
    embeds = torch.cat([torch.nn.functional.pad(r, (0, 0, 0, longest - r.shape[1])) for r in rows])
    lengths = torch.cat(lengths)
    return embeds, torch.arange(longest, device=device)[None, :] < lengths[:, None]


# ---------------------------------------------------------------- stage 4: the DiT


def shifted_sigma(u: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """The pipeline scheduler's own time shift of `u`, with the mu the pipeline computes for this many
    image tokens: sigmas drawn from uniform u follow the sampler's shifted schedule."""
    scheduler, mu = schedule_shift(image_tokens)
    return scheduler.time_shift(mu, 1.0, u)


@cache
def schedule_shift(image_tokens: int) -> tuple[FlowMatchEulerDiscreteScheduler, float]:
    """The pipeline's scheduler and its mu for `image_tokens` (as `Pipeline.denoise` computes it)."""
    scheduler = default_scheduler()
    return scheduler, shift_mu(scheduler, image_tokens)


def flow_matching_pair(
    x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t = (1 - sigma) x0 + sigma noise and the velocity target noise - x0 ([B, tokens, 64], sigma [B])."""
    s = sigma[:, None, None]
    return (1.0 - s) * x0 + s * noise, noise - x0


def train_dit(
    model,
    latents: torch.Tensor,
    embeds: torch.Tensor,
    masks: torch.Tensor,
    negative: tuple[torch.Tensor, torch.Tensor],
    settings: Settings,
    log: LossLog,
) -> tuple[torch.nn.Module, dict]:
    """Flow matching on precomputed tensors; returns the EMA model (fp32) and throughput."""
    sizes, device = settings.sizes, latents.device
    side = sizes.image_size // 16
    grid = (1, side, side)
    generator = torch.Generator(device).manual_seed(settings.seed + 2)
    model.to(device).train().requires_grad_(True)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    run = Optimisation("dit", params, sizes.dit_lr, (0.9, 0.95), sizes.dit_steps, sizes.dit_batch, log)
    forward = torch.compile(model) if settings.compile else model
    negative_embeds, negative_mask = negative
    for step in run.steps(settings.probe_seconds):
        pair = torch.randint(len(embeds), (sizes.dit_batch,), device=device, generator=generator)
        x0 = latents[pair // 2].float()
        drop = torch.rand(sizes.dit_batch, device=device, generator=generator) < TEXT_DROPOUT
        text = torch.where(drop[:, None, None], negative_embeds, embeds[pair])
        mask = torch.where(drop[:, None], negative_mask, masks[pair])
        u = torch.rand(sizes.dit_batch, generator=generator, device=device).clamp(1e-4, 1.0)
        sigma = shifted_sigma(u, latents.shape[1])
        noise = torch.randn(x0.shape, generator=generator, device=device)
        x_t, target = flow_matching_pair(x0, noise, sigma)
        with torch.autocast(device.type, torch.bfloat16, enabled=settings.amp):
            velocity = forward(x_t, text, mask, sigma, grid)
        run.update(torch.nn.functional.mse_loss(velocity.float(), target))
        decay = min(EMA_DECAY, (1 + step) / (10 + step))
        torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1.0 - decay)
    return ema, run.summary()


# ---------------------------------------------------------------- stage 5: held-out checks


def score_images(images: list[np.ndarray], descriptions: list) -> dict:
    """qwen_image_fusion.eval.meaning accuracy of the images, or why it is unavailable (its checker needs
    scikit-image)."""
    try:
        from qwen_image_fusion.eval.meaning import accuracy, check_image
    except ImportError as err:
        return {"unavailable": f"qwen_image_fusion.eval.meaning cannot be imported here: {err}"}
    return accuracy([check_image(i, d) for i, d in zip(images, descriptions, strict=True)])


@torch.no_grad()
def check_reconstructions(
    vae, held_out: list, size: int, device: torch.device, amp: bool
) -> tuple[dict, np.ndarray]:
    """PSNR of the VAE's reconstructions of the held-out renders and the checker on them: the ceiling the
    DiT can reach through this decoder. Also returns a grid image (renders above reconstructions)."""
    pixels = torch.from_numpy(np.stack([np.asarray(render(s, size)) for s in held_out])).to(device)
    x = to_vae_input(pixels)
    outputs = []
    for chunk in x.split(32):
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            outputs.append(vae.decode(vae.encode(chunk).latent_dist.mode()).sample.float())
    reconstruction = torch.cat(outputs)
    mse = ((reconstruction - x) / 2).square().mean(dim=(1, 2, 3, 4)).clamp_min(1e-10)
    as_uint8 = ((reconstruction[:, :, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    recon = as_uint8.permute(0, 2, 3, 1).cpu().numpy()
    stats = {
        "images": len(held_out),
        "psnr_db_mean": float((-10 * torch.log10(mse)).mean()),
        "checker": score_images(list(recon), [s.description for s in held_out]),
    }
    shown = min(8, len(held_out))
    grid = np.concatenate(
        [
            np.concatenate(list(pixels[:shown].cpu().numpy()), axis=1),
            np.concatenate(list(recon[:shown]), axis=1),
        ]
    )
    return stats, grid


@torch.no_grad()
def sample_held_out(
    components: Components, held_out: list, size: int, device: torch.device
) -> tuple[dict, dict]:
    """The held-out captions (English and Chinese) through the real pipeline with the trained weights: 20
    steps, true CFG 4 with the negative prompt text dropout trained. Returns scores and PNG images by name."""
    model = QwenImageModel(components, device, torch.bfloat16)
    spec = FAMILY.spec_for(model, "training", sampling_defaults(size))
    pipe = Pipeline.from_model(model, spec, "reference")
    pipe.cuda_graphs = False
    stats, images = {}, {}
    for language in LANGUAGES:
        arrays = []
        for start in range(0, len(held_out), SAMPLE_BATCH):
            chunk = held_out[start : start + SAMPLE_BATCH]
            generated = pipe.generate(
                [s.captions[language] for s in chunk],
                seed=SAMPLE_SEED + start,
            )
            arrays += [np.asarray(image) for image in generated]
        stats[language] = score_images(arrays, [s.description for s in held_out])
        images |= {f"s{i:03d}-{language}.png": pixels for i, pixels in enumerate(arrays)}
    return stats, images


def trained_components(tokenizer, text_encoder, transformer, vae, device: torch.device) -> Components:
    """The trained weights as the pipeline runs them: bf16, eval mode, hooks run as after loading."""
    model = copy.deepcopy(transformer).to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    model.post_load_weights()
    return Components(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=model,
        vae=cast_parameters(copy.deepcopy(vae), torch.bfloat16, device),
        scheduler=default_scheduler(),
    )


# ---------------------------------------------------------------- output


def write_tar(vae, transformer, settings: Settings, meta: dict, log: LossLog, pictures: dict) -> Path:
    """VAE and DiT (bf16 safetensors + configs), the loss log, metadata and `pictures` (name -> uint8 RGB)
    as PNGs under samples/, in one tar under --out."""
    settings.out.mkdir(parents=True, exist_ok=True)
    tar_path = settings.out / TAR_NAME
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        copy.deepcopy(vae).cpu().to(torch.bfloat16).save_pretrained(root / "vae")
        model = copy.deepcopy(transformer).cpu().to(torch.bfloat16)
        save_transformer(model, root / "transformer")
        (root / "train_meta.json").write_text(json.dumps(meta, indent=2))
        (root / "train_log.jsonl").write_text(log.path.read_text())
        (root / "samples").mkdir()
        for name, pixels in pictures.items():
            Image.fromarray(pixels).save(root / "samples" / name)
        with tarfile.open(tar_path, "w") as tar:
            for name in ("vae", "transformer", "train_meta.json", "train_log.jsonl", "samples"):
                tar.add(root / name, arcname=name)
    size = tar_path.stat().st_size
    if size > MAX_TAR_BYTES:
        print(
            f"warning: {tar_path} is {size / 2**20:.1f} MiB, over the device tool's 16 MiB", file=sys.stderr
        )
    return tar_path


def environment(device: torch.device) -> dict:
    import diffusers
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "pillow": PIL.__version__,
        "numpy": np.__version__,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
    }


def run(settings: Settings) -> dict:
    """All four stages; returns the metadata written into the tar (and printed)."""
    sizes = settings.sizes
    settings.out.mkdir(parents=True, exist_ok=True)
    log = LossLog(settings.out / "train_log.jsonl")
    timings: dict[str, float] = {}
    start = lap = time.perf_counter()

    def stage_done(name: str) -> None:
        nonlocal lap
        now = time.perf_counter()
        timings[name] = round(now - lap, 2)
        lap = now

    pixels, captions = render_scenes(settings.seed, sizes.scenes, sizes.image_size, settings.workers)
    stage_done("render")

    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(settings.seed)
    images = torch.from_numpy(pixels).to(device)
    tokenizer = build_qwen2_tokenizer()
    text_encoder = cast_parameters(build_text_encoder(sizes.text_hidden), torch.bfloat16, device)
    contiguous_logit_rows(text_encoder)
    vae = (
        build_vae(sizes.vae) if settings.vae_from is None else load_vae_from_tar(settings.vae_from, sizes.vae)
    )
    transformer = build_transformer(sizes.dit, settings.seed)
    stage_done("setup")

    if settings.vae_from is None:
        vae_stats = train_vae(vae, images, settings, log)
    else:
        vae.to(device).eval().requires_grad_(False)
        vae_stats = {"from": str(settings.vae_from)}
    stage_done("vae_train")
    held_out = held_out_scenes(sizes.held_out_samples)
    vae_stats["held_out_reconstruction"], grid = check_reconstructions(
        vae, held_out, sizes.image_size, device, settings.amp
    )
    stage_done("vae_check")
    encode_start = time.perf_counter()
    latents = normalise_latents(vae, encode_latents(vae, images, sizes.vae_batch * 2, settings.amp))
    synchronize(device)
    vae_stats["encode_images_per_s"] = len(images) / (time.perf_counter() - encode_start)
    del images
    stage_done("vae_encode")
    text_start = time.perf_counter()
    embeds, masks = encode_captions(text_encoder, tokenizer, captions, device)
    negative_embeds, negative_mask = encode_captions(text_encoder, tokenizer, [NEGATIVE_PROMPT], device)
    negative = (
        torch.nn.functional.pad(negative_embeds, (0, 0, 0, embeds.shape[1] - negative_embeds.shape[1])),
        torch.nn.functional.pad(negative_mask, (0, embeds.shape[1] - negative_mask.shape[1])),
    )
    synchronize(device)
    text_stats = {"captions": len(captions), "max_tokens": embeds.shape[1]}
    text_stats["captions_per_s"] = len(captions) / (time.perf_counter() - text_start)
    stage_done("text_encode")

    ema, dit_stats = train_dit(transformer, latents, embeds, masks, negative, settings, log)
    stage_done("dit_train")
    samples: dict = {}
    if settings.probe_seconds is None:
        components = trained_components(tokenizer, text_encoder, ema, vae, device)
        dit_stats["held_out_samples"], samples = sample_held_out(
            components, held_out, sizes.image_size, device
        )
        stage_done("samples")
    timings["total"] = round(time.perf_counter() - start, 2)
    meta = {
        "what": "Qwen-Image architecture trained on eval/scenes.py drawings by training/train_default.py",
        "preset": settings.preset,
        "seed": settings.seed,
        "probe": settings.probe_seconds is not None,
        "sizes": {
            **{k: v for k, v in asdict(sizes).items() if k != "dit"},
            "dit": sizes.dit.to_dict(),
        },
        "amp": settings.amp,
        "compile": settings.compile,
        "text_encoder": {
            "seed": TEXT_ENCODER_SEED,
            "hidden_size": sizes.text_hidden,
            "tied_embeddings": True,
        },
        "negative_prompt": NEGATIVE_PROMPT,
        "text_dropout": TEXT_DROPOUT,
        "ema_decay": EMA_DECAY,
        "held_out_percent": HELD_OUT_PERCENT,
        "scenes": sizes.scenes,
        "render_scenes_per_s": sizes.scenes / max(timings["render"], 1e-9),
        "samples": {
            "steps": SAMPLE_STEPS,
            "true_cfg_scale": SAMPLE_CFG_SCALE,
            "seed": SAMPLE_SEED,
            "variant": "reference",
        },
        "vae": vae_stats,
        "text": text_stats,
        "dit": dit_stats,
        "timings_s": timings,
        "environment": environment(device),
    }
    if settings.probe_seconds is None:
        pictures = samples | {"vae_reconstructions.png": grid}
        meta["tar"] = str(write_tar(vae, ema, settings, meta, log, pictures))
    return meta


def sizing_advice(meta: dict, vae_seconds: float, dit_seconds: float, scenes: int) -> list[str]:
    """From a probe: step counts that fill the given seconds, and the whole run's expected time."""
    lines = []
    vae_rate, dit_rate = meta["vae"]["steps_per_s"], meta["dit"]["steps_per_s"]
    if vae_rate:
        lines.append(
            f"vae: {vae_rate:.2f} steps/s ({meta['vae']['images_per_s']:.0f} images/s) -> "
            f"--vae-steps {int(vae_rate * vae_seconds)} for {vae_seconds:.0f} s"
        )
    if dit_rate:
        lines.append(
            f"dit: {dit_rate:.2f} steps/s ({meta['dit']['images_per_s']:.0f} samples/s) -> "
            f"--dit-steps {int(dit_rate * dit_seconds)} for {dit_seconds:.0f} s"
        )
    prep = (
        scenes / meta["render_scenes_per_s"]
        + scenes / meta["vae"]["encode_images_per_s"]
        + 2 * scenes / meta["text"]["captions_per_s"]
    )
    lines.append(
        f"data for {scenes} scenes: about {prep:.0f} s (render {meta['render_scenes_per_s']:.0f} scenes/s, "
        f"vae encode {meta['vae']['encode_images_per_s']:.0f} images/s, "
        f"text {meta['text']['captions_per_s']:.0f} captions/s); setup {meta['timings_s']['setup']:.0f} s"
    )
    lines.append(
        f"expected run: about {prep + meta['timings_s']['setup'] + vae_seconds + dit_seconds:.0f} s "
        "plus python start-up and imports"
    )
    return lines


def parse_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_image_fusion.training.train_default", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (tar, loss log)")
    parser.add_argument("--preset", choices=sorted(RECIPES), default="default")
    parser.add_argument("--seed", type=int, default=0, help="scene stream, initialisation and sampling seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=min(16, multiprocessing.cpu_count()))
    parser.add_argument(
        "--scenes", type=int, help="training scenes (each gives an English and a Chinese caption)"
    )
    parser.add_argument("--vae-steps", type=int)
    parser.add_argument("--vae-batch", type=int)
    parser.add_argument("--vae-lr", type=float)
    parser.add_argument("--dit-steps", type=int)
    parser.add_argument("--dit-batch", type=int)
    parser.add_argument("--dit-lr", type=float)
    parser.add_argument(
        "--samples",
        type=int,
        dest="held_out_samples",
        help="held-out scenes checked after training (default 100)",
    )
    parser.add_argument(
        "--no-amp",
        action="store_true",
        help="fp32 instead of bf16 autocast on CUDA (CPU runs are always fp32)",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the DiT training forward")
    parser.add_argument(
        "--vae-from", type=Path, metavar="TAR",
        help="reuse the VAE of an earlier run's default_model.tar (same preset) and train only the DiT",
    )  # fmt: skip
    parser.add_argument(
        "--probe", type=float, nargs="?", const=20.0, metavar="SECONDS",
        help="run each training stage for SECONDS (default 20) on a fraction of the scenes, print throughput "
        "and the step counts that fill --vae-seconds / --dit-seconds; writes no model",
    )  # fmt: skip
    parser.add_argument("--vae-seconds", type=float, default=180.0, help="VAE budget the probe sizes for")
    parser.add_argument("--dit-seconds", type=float, default=300.0, help="DiT budget the probe sizes for")
    args = parser.parse_args(argv)
    preset = RECIPES[args.preset]
    overrides = {
        key: getattr(args, key)
        for key in (
            *("scenes", "vae_steps", "vae_batch", "vae_lr"),
            *("dit_steps", "dit_batch", "dit_lr", "held_out_samples"),
        )
        if getattr(args, key) is not None
    }
    if args.probe is not None:  # the schedules keep the real step counts; time ends each stage
        overrides.setdefault("scenes", min(preset.scenes, 8192))
    sizes = replace(preset, **overrides)
    if min(sizes.scenes, sizes.vae_steps, sizes.vae_batch, sizes.dit_steps, sizes.dit_batch) < 1:
        parser.error("--scenes, step counts and batch sizes must be positive")
    if sizes.held_out_samples < 1:
        parser.error("--samples must be positive")
    if args.vae_from is not None and not args.vae_from.is_file():
        parser.error(f"--vae-from {args.vae_from} is not a file")
    return Settings(
        preset=args.preset,
        sizes=sizes,
        seed=args.seed,
        device=args.device,
        workers=args.workers,
        amp=torch.device(args.device).type == "cuda" and not args.no_amp,
        compile=args.compile,
        vae_from=args.vae_from,
        probe_seconds=args.probe,
        out=args.out,
    ), args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    meta = run(settings)
    print(json.dumps(meta, indent=2))
    if settings.probe_seconds is not None:
        scenes = args.scenes or RECIPES[args.preset].scenes
        print("\n".join(sizing_advice(meta, args.vae_seconds, args.dit_seconds, scenes)))
    else:
        assemble = f"python -m qwen_image_fusion.training.assemble {meta['tar']} DIR"
        print(f"wrote {meta['tar']}; build the checkpoint with: {assemble}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
