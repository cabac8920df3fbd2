"""Train the embedded default model on drawn scenes: the VAE as an autoencoder, then the DiT by flow matching.

    python -m training.train_default --out out/train                  # the real run (H200, one call)
    python -m training.train_default --probe --out out/probe          # ~20 s per stage: throughput, sizing
    python -m training.train_default --preset cpu --out out/cpu       # the 64 px CPU de-risk
    python -m training.train_default --preset smoke --out /tmp/smoke  # seconds (tests)

Stages: (1) render the training scenes (eval.scenes, held-out object keys excluded) in worker processes;
(2) train `AutoencoderKLQwenImage` on them (L1 + a small KL, decoding posterior samples); (3) encode every
scene once: VAE posterior means, normalised with the VAE's latents_mean/std (measured here and written to
its config, so the pipeline's decode inverts exactly this) and packed 2x2 as the pipeline packs them, and
both captions (English, Chinese) through the frozen text encoder with `encode_prompts`, as the pipeline
does; (4) train the DiT on those tensors alone: x_t = (1 - sigma) x0 + sigma noise, target noise - x0, the
model gets sigma, sigma = the scheduler's own time shift (mu of this image size) of a uniform u, so
training covers the sampler's shifted schedule; 10% of captions become the negative prompt " " so true
CFG works. One tar (< 16 MiB) holds the VAE, the DiT (EMA weights, bf16), the loss log and the run's
metadata; `training.assemble` turns it into a checkpoint directory.
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
from pathlib import Path

import numpy as np
import PIL
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from tqdm.auto import tqdm

from eval.scenes import HELD_OUT_PERCENT, draw_scene, render
from models.components import default_scheduler
from models.embedded import cast_parameters
from models.loading import save_transformer
from models.math import pack_latents
from models.text_encoder import encode_prompts
from models.tokenizer import build_qwen2_tokenizer
from training.recipe import (
    NEGATIVE_PROMPT,
    PRESETS,
    TEXT_ENCODER_SEED,
    Preset,
    build_text_encoder,
    build_transformer,
    build_vae,
)

TAR_NAME = "default_model.tar"
MAX_TAR_BYTES = 16 * 1024**2  # the device tool returns files of at most 16 MiB
TEXT_DROPOUT = 0.1
VAE_KL_WEIGHT = 1e-6
EMA_DECAY = 0.999
WARMUP_FRACTION = 0.03
LOG_EVERY = 25
PROBE_WARMUP_STEPS = 3


@dataclass(frozen=True)
class Settings:
    """A resolved command line: the preset with the arguments that override it."""

    preset: str
    sizes: Preset
    seed: int
    device: str
    workers: int
    amp: bool
    compile: bool
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
    """L1 reconstruction of posterior samples plus a small KL; returns throughput and the last loss."""
    sizes, device = settings.sizes, images.device
    generator = torch.Generator(device).manual_seed(settings.seed + 1)
    vae.to(device).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=sizes.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    running = torch.zeros((), device=device)
    timer = Throughput(device, sizes.vae_batch)
    for step in steps_of(sizes.vae_steps, settings.probe_seconds, "vae"):
        for group in optimizer.param_groups:
            group["lr"] = sizes.vae_lr * lr_factor(step, sizes.vae_steps)
        index = torch.randint(len(images), (sizes.vae_batch,), device=device, generator=generator)
        x = to_vae_input(images[index])
        with torch.autocast(device.type, torch.bfloat16, enabled=settings.amp):
            posterior = vae.encode(x).latent_dist
            reconstruction = vae.decode(posterior.sample(generator=generator)).sample
        mean, logvar = posterior.mean.float(), posterior.logvar.float()
        kl = 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).mean()
        loss = (reconstruction.float() - x).abs().mean() + VAE_KL_WEIGHT * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        running += loss.detach()
        timer.tick(step)
        if (step + 1) % LOG_EVERY == 0:
            log.write({"stage": "vae", "step": step + 1, "loss": running.item() / LOG_EVERY, **timer.row()})
            running.zero_()
    vae.eval().requires_grad_(False)
    return timer.summary() | {"last_loss": log.rows[-1]["loss"] if log.rows else None}


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
    return the packed, normalised latents [N, tokens, 64] in bf16."""
    mean = latents.mean(dim=(0, 2, 3))
    std = latents.std(dim=(0, 2, 3))
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    shape = (1, -1, 1, 1)
    normalised = (latents - mean.view(shape)) * (1.0 / std).view(shape)
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


def sigma_sampler(image_tokens: int):
    """sigma = the pipeline scheduler's time shift of u ~ U(0, 1), with the pipeline's mu for this size."""
    scheduler = default_scheduler()
    config = scheduler.config
    mu = calculate_shift(
        image_tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )

    def sample(batch: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        u = torch.rand(batch, generator=generator, device=device).clamp(1e-4, 1.0)
        return scheduler.time_shift(mu, 1.0, u)

    return sample


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
    sample_sigma = sigma_sampler(latents.shape[1])
    model.to(device).train().requires_grad_(True)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    optimizer = torch.optim.AdamW(
        params, lr=sizes.dit_lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda"
    )
    forward = torch.compile(model) if settings.compile else model
    negative_embeds, negative_mask = negative
    running = torch.zeros((), device=device)
    timer = Throughput(device, sizes.dit_batch)
    for step in steps_of(sizes.dit_steps, settings.probe_seconds, "dit"):
        for group in optimizer.param_groups:
            group["lr"] = sizes.dit_lr * lr_factor(step, sizes.dit_steps)
        pair = torch.randint(len(embeds), (sizes.dit_batch,), device=device, generator=generator)
        x0 = latents[pair // 2].float()
        drop = torch.rand(sizes.dit_batch, device=device, generator=generator) < TEXT_DROPOUT
        text = torch.where(drop[:, None, None], negative_embeds, embeds[pair])
        mask = torch.where(drop[:, None], negative_mask, masks[pair])
        sigma = sample_sigma(sizes.dit_batch, generator, device)
        noise = torch.randn(x0.shape, generator=generator, device=device)
        x_t = (1.0 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        with torch.autocast(device.type, torch.bfloat16, enabled=settings.amp):
            velocity = forward(x_t, text, mask, sigma, grid)
        loss = torch.nn.functional.mse_loss(velocity.float(), noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        decay = min(EMA_DECAY, (1 + step) / (10 + step))
        torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1.0 - decay)
        running += loss.detach()
        timer.tick(step)
        if (step + 1) % LOG_EVERY == 0:
            log.write({"stage": "dit", "step": step + 1, "loss": running.item() / LOG_EVERY, **timer.row()})
            running.zero_()
    dit_rows = [r for r in log.rows if r["stage"] == "dit"]
    return ema, timer.summary() | {"last_loss": dit_rows[-1]["loss"] if dit_rows else None}


# ---------------------------------------------------------------- output


def write_tar(vae, transformer, settings: Settings, meta: dict, log: LossLog) -> Path:
    """VAE and DiT (bf16 safetensors + configs), the loss log and metadata in one tar under --out."""
    settings.out.mkdir(parents=True, exist_ok=True)
    tar_path = settings.out / TAR_NAME
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        copy.deepcopy(vae).cpu().to(torch.bfloat16).save_pretrained(root / "vae")
        model = copy.deepcopy(transformer).cpu().to(torch.bfloat16)
        save_transformer(model, root / "transformer")
        (root / "train_meta.json").write_text(json.dumps(meta, indent=2))
        (root / "train_log.jsonl").write_text(log.path.read_text())
        with tarfile.open(tar_path, "w") as tar:
            for name in ("vae", "transformer", "train_meta.json", "train_log.jsonl"):
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
    vae = build_vae(sizes.vae)
    transformer = build_transformer(sizes.dit, settings.seed)
    stage_done("setup")

    vae_stats = train_vae(vae, images, settings, log)
    stage_done("vae_train")
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
    timings["total"] = round(time.perf_counter() - start, 2)
    meta = {
        "what": "Qwen-Image architecture trained on eval.scenes drawings by training/train_default.py",
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
        "vae": vae_stats,
        "text": text_stats,
        "dit": dit_stats,
        "timings_s": timings,
        "environment": environment(device),
    }
    if settings.probe_seconds is None:
        meta["tar"] = str(write_tar(vae, ema, settings, meta, log))
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
        prog="python -m training.train_default", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (tar, loss log)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
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
    parser.add_argument("--no-amp", action="store_true", help="fp32 instead of bf16 autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile the DiT training forward")
    parser.add_argument(
        "--probe", type=float, nargs="?", const=20.0, metavar="SECONDS",
        help="run each training stage for SECONDS (default 20) on a fraction of the scenes, print throughput "
        "and the step counts that fill --vae-seconds / --dit-seconds; writes no model",
    )  # fmt: skip
    parser.add_argument("--vae-seconds", type=float, default=180.0, help="VAE budget the probe sizes for")
    parser.add_argument("--dit-seconds", type=float, default=300.0, help="DiT budget the probe sizes for")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    overrides = {
        key: getattr(args, key)
        for key in ("scenes", "vae_steps", "vae_batch", "vae_lr", "dit_steps", "dit_batch", "dit_lr")
        if getattr(args, key) is not None
    }
    if args.probe is not None:  # the schedules keep the real step counts; time ends each stage
        overrides.setdefault("scenes", min(preset.scenes, 8192))
    sizes = replace(preset, **overrides)
    if min(sizes.scenes, sizes.vae_steps, sizes.vae_batch, sizes.dit_steps, sizes.dit_batch) < 1:
        parser.error("--scenes, step counts and batch sizes must be positive")
    return Settings(
        preset=args.preset,
        sizes=sizes,
        seed=args.seed,
        device=args.device,
        workers=args.workers,
        amp=not args.no_amp,
        compile=args.compile,
        probe_seconds=args.probe,
        out=args.out,
    ), args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    meta = run(settings)
    print(json.dumps(meta, indent=2))
    if settings.probe_seconds is not None:
        scenes = args.scenes or PRESETS[args.preset].scenes
        print("\n".join(sizing_advice(meta, args.vae_seconds, args.dit_seconds, scenes)))
    else:
        print(
            f"wrote {meta['tar']}; build the checkpoint with: python -m training.assemble {meta['tar']} DIR"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
