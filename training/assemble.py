"""Build a diffusers-layout checkpoint directory from the tar `train_default` writes.

    python -m training.assemble out/train/default_model.tar out/default-model

The tar holds the trained VAE and DiT; this adds the frozen text encoder (rebuilt from the seed and size
recorded in the tar, so it is the one the DiT was trained with), the Qwen2 tokenizer, the pipeline's
scheduler and `model_index.json` (`models.components.save_components`), plus `training/` with the run's
metadata and loss log. Everything is stored in bf16; the result loads with `pipelines.load_pipeline(DIR)`.
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

from models.components import Components, default_scheduler, save_components
from models.embedded import cast_parameters
from models.errors import CheckpointError, InputError, QwenImageError
from models.loading import load_transformer
from models.tokenizer import build_qwen2_tokenizer
from training.recipe import TEXT_ENCODER_SEED, build_text_encoder

MEMBERS = ("vae", "transformer", "train_meta.json", "train_log.jsonl")
CPU = torch.device("cpu")


def read_tar(tar_path: Path, into: Path) -> dict:
    """Extract the expected members (and only them) and return the run's metadata."""
    if not tar_path.is_file():
        raise InputError(f"training tar not found: {tar_path}")
    try:
        with tarfile.open(tar_path) as tar:
            names = tar.getnames()
            missing = [m for m in MEMBERS if m not in names]
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
        components = Components(
            tokenizer=build_qwen2_tokenizer(),
            text_encoder=cast_parameters(
                build_text_encoder(meta["text_encoder"]["hidden_size"]), torch.bfloat16, CPU
            ),
            transformer=load_transformer(root / "transformer", torch.bfloat16, CPU),
            vae=AutoencoderKLQwenImage.from_pretrained(
                root / "vae", torch_dtype=torch.bfloat16, local_files_only=True
            ),
            scheduler=default_scheduler(),
        )
        save_components(components, out)
        (out / "training").mkdir()
        for name in ("train_meta.json", "train_log.jsonl"):
            shutil.copy(root / name, out / "training" / name)
    return out


def weight_bytes(directory: Path) -> dict[str, int]:
    """Bytes of safetensors per component folder."""
    return {
        sub.name: sum(f.stat().st_size for f in sub.glob("*.safetensors"))
        for sub in sorted(directory.iterdir())
        if sub.is_dir()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.assemble", description=__doc__.splitlines()[0])
    parser.add_argument("tar", type=Path, help="default_model.tar written by training.train_default")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
