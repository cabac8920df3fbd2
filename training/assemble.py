"""Build a diffusers-layout checkpoint directory from the tar `train_default` writes.

    python -m qwen_image_fusion.training.assemble out/train/default_model.tar out/default-model

The tar holds the trained VAE and DiT; this adds the frozen text encoder (rebuilt from the seed and size
recorded in the tar, so it is the one the DiT was trained with), the Qwen2 tokenizer, the pipeline's scheduler
and `model_index.json` (`qwen_image_fusion.models.qwen_image.components.save_components`), plus `training/`
with the run's metadata, loss log and the checker's scores of the held-out samples the run generated.
Everything is stored in bf16; the result loads with `qwen_image_fusion.pipelines.load_pipeline(DIR)`.
"""

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage
from PIL import Image

from qwen_image_fusion.eval.scenes import held_out_scenes
from qwen_image_fusion.models.errors import CheckpointError, InputError, QwenImageError
from qwen_image_fusion.models.loading import load_transformer
from qwen_image_fusion.models.qwen_image.components import (
    Components,
    build_transformer,
    default_scheduler,
    save_components,
)
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.training.recipe import (
    TEXT_ENCODER_SEED,
    build_text_encoder,
    cast_parameters,
    sampling_defaults,
)

MEMBERS = ("vae", "transformer", "train_meta.json", "train_log.jsonl", "samples")
CPU = torch.device("cpu")


def read_tar(tar_path: Path, into: Path) -> dict:
    """Extract the expected members (and only them) and return the run's metadata."""
    if not tar_path.is_file():
        raise InputError(f"training tar not found: {tar_path}")
    try:
        with tarfile.open(tar_path) as tar:
            names = tar.getnames()
            missing = [m for m in MEMBERS[:4] if m not in names]
            if missing:
                raise CheckpointError(f"{tar_path} lacks {', '.join(missing)}: not a train_default output")
            tar.extractall(
                into, members=[m for m in tar.getmembers() if m.name.split("/")[0] in MEMBERS], filter="data"
            )
    except tarfile.TarError as err:
        raise CheckpointError(f"cannot read {tar_path}: {err}") from err
    meta = json.loads((into / "train_meta.json").read_text())
    text = meta["text_encoder"]
    if text["seed"] != TEXT_ENCODER_SEED:
        raise CheckpointError(
            f"{tar_path} was trained with text encoder seed {text['seed']}, "
            f"this code builds seed {TEXT_ENCODER_SEED}"
        )
    return meta


def assemble(tar_path: Path, out: Path) -> Path:
    """Write the checkpoint directory `out` (which must not exist or be empty); returns it."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"output {out} exists and is not an empty directory")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        meta = read_tar(tar_path, root)
        hidden = meta["text_encoder"]["hidden_size"]
        components = Components(
            tokenizer=build_qwen2_tokenizer(),
            text_encoder=cast_parameters(build_text_encoder(hidden), torch.bfloat16, CPU),
            transformer=load_transformer(root / "transformer", build_transformer, torch.bfloat16, CPU),
            vae=AutoencoderKLQwenImage.from_pretrained(
                root / "vae", torch_dtype=torch.bfloat16, local_files_only=True
            ),
            scheduler=default_scheduler(),
        )
        image_size = meta["sizes"]["image_size"]
        save_components(components, out, defaults=sampling_defaults(image_size), builtin_tokenizer=True)
        (out / "training").mkdir()
        for name in ("train_meta.json", "train_log.jsonl"):
            shutil.copy(root / name, out / "training" / name)
        scores = score_samples(root / "samples")
        if scores is not None:
            (out / "training" / "held_out_samples.json").write_text(json.dumps(scores, indent=2))
    return out


def score_samples(folder: Path) -> dict | None:
    """qwen_image_fusion.eval.meaning accuracy of the held-out samples the run generated (`sNNN-LANG.png`),
    scored here because the training machine may lack the checker's scikit-image; None when there are none."""
    from qwen_image_fusion.eval.meaning import accuracy, check_image

    files = sorted(folder.glob("s[0-9][0-9][0-9]-*.png")) if folder.is_dir() else []
    if not files:
        return None
    by_language: dict[str, list[Path]] = {}
    for path in files:
        by_language.setdefault(path.stem.split("-")[1], []).append(path)
    scenes = held_out_scenes(max(len(paths) for paths in by_language.values()))
    return {
        language: accuracy(
            [check_image(Image.open(p), s.description) for p, s in zip(paths, scenes, strict=False)]
        )
        for language, paths in sorted(by_language.items())
    }


def weight_bytes(directory: Path) -> dict[str, int]:
    """Bytes of safetensors per component folder."""
    return {
        sub.name: sum(f.stat().st_size for f in sub.glob("*.safetensors"))
        for sub in sorted(directory.iterdir())
        if sub.is_dir()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_image_fusion.training.assemble", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "tar", type=Path, help="default_model.tar written by qwen_image_fusion.training.train_default"
    )
    parser.add_argument("out", type=Path, help="checkpoint directory to create")
    args = parser.parse_args(argv)
    try:
        out = assemble(args.tar, args.out)
    except QwenImageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sizes = weight_bytes(out)
    listing = ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in sizes.items() if size)
    print(f"wrote {out}: {sum(sizes.values()) / 1e6:.2f} MB of safetensors ({listing})")
    scores = out / "training" / "held_out_samples.json"
    if scores.is_file():
        for language, acc in json.loads(scores.read_text()).items():
            print(
                f"held-out samples of the run, {language}: colour+position {acc['colour_position']:.1%}, "
                f"count {acc['count']:.1%} over {acc['images']} images"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
