"""Shared fixtures: tiny tokenizers with real chat templates and tiny models saved to disk.

Nothing is downloaded: tokenizers are trained on a few lines of text, models are built from a
config, `save_pretrained` to a temp dir and loaded back by path so the real loading code runs.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # Launchers and ranks the tests start import the tests' own plugins by name
    # (prepare=tests.dist_scripts.world:prepare_tiny), as a user's plugin module on PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

def free_port() -> int:
    """A TCP port free now on 127.0.0.1, for a launcher's --master_port (29500 may be taken)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A transcription of the chat template Qwen3 instruct models ship (from the project's shared
# fixtures, copied so that a clone runs its tests wherever it lies).
QWEN3_TEMPLATE_PATH = Path(__file__).resolve().parent / "fixtures" / "qwen3.jinja"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<think>", "</think>"]
CORPUS = [
    "What is 12 * 7? Use the calculator.",
    '{"name": "calculator", "arguments": {"expression": "12 * 7"}}',
    '{"result": 84} The answer is 84.',
    "Convert 3 km to m. lookup the population of Veltrane.",
    "system user assistant tool You may call one or more functions",
] * 20


def _corpus() -> list[str]:
    """Example lines plus the built-in tool schemas, so prompts with tools stay short."""
    import json

    from worlds.toolcalc.tools import registry as builtin_registry
    return CORPUS + [json.dumps(schema) for schema in builtin_registry().schemas] * 20


def build_tokenizer(chat_template: str, save_dir: Path | None = None):
    """A byte-level BPE tokenizer with Qwen-style special tokens and the given template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.add_tokens(ADDED_TOKENS)
    tokenizer.chat_template = chat_template
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


@pytest.fixture(scope="session")
def qwen3_template() -> str:
    return QWEN3_TEMPLATE_PATH.read_text()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_template):
    return build_tokenizer(qwen3_template)


@pytest.fixture(scope="session")
def compact_tokenizer():
    """Our own Hermes-style template that lists tool names only: short prompts for real models."""
    return build_tokenizer((Path(__file__).parent / "compact.jinja").read_text())


def build_tiny_model(tokenizer, save_dir: Path, *, architecture: str = "qwen2", seed: int = 0,
                     hidden_size: int = 32, num_layers: int = 2, vocab_size: int | None = None,
                     tie_word_embeddings: bool = False):
    """A tiny causal LM for `tokenizer`, saved with `save_pretrained` and loaded back by path.

    `vocab_size` defaults to the tokenizer's length; real checkpoints pad it (Qwen3: 151,936).
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[architecture]
    # Qwen3 sets head_dim apart from hidden / heads; 32 keeps its q/k RMSNorm realistic.
    shape = {"head_dim": 32} if architecture == "qwen3" else {}
    config = config_cls(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden_size,
                        intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                        num_attention_heads=4, num_key_value_heads=2, **shape,
                        max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return AutoModelForCausalLM.from_pretrained(save_dir, attn_implementation="sdpa",
                                                dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model(qwen3_tokenizer, tmp_path_factory):
    return build_tiny_model(qwen3_tokenizer, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def real_qwen3_tokenizer():
    """The real Qwen3 tokenizer (151,669 tokens), built offline and cached (tests/qwen3_tokenizer.py)."""
    from qwen3_tokenizer import load_qwen3_tokenizer
    return load_qwen3_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen3_dir(real_qwen3_tokenizer, tmp_path_factory) -> Path:
    """A random 2-layer Qwen3 with the real tokenizer and Qwen3's padded 151,936-row vocabulary."""
    from qwen3_tokenizer import QWEN3_VOCAB_SIZE

    path = tmp_path_factory.mktemp("tiny_qwen3")
    build_tiny_model(real_qwen3_tokenizer, path, architecture="qwen3", hidden_size=64,
                     vocab_size=QWEN3_VOCAB_SIZE)
    return path


@pytest.fixture(scope="module")
def executor():
    """The toolcalc tools in the real sandbox (a module overrides it with its own tools)."""
    from opd.tools import ToolExecutor
    from worlds.toolcalc.tools import registry

    with ToolExecutor(registry(), timeout_s=5.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def tools():
    """The toolcalc tools' OpenAI schemas."""
    from worlds.toolcalc.tools import registry

    return registry().schemas
