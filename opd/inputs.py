"""Everything a run reads besides the weights, checked before any engine starts.

A mistake in a path, a tokenizer, a dataset line or a budget costs one sentence naming the key,
file or line, seconds after launch instead of a traceback hours into a run: the student and
teacher directories hold Hugging Face configs whose vocabularies cover the tokenizer, the
tokenizer has a usable chat template, every dataset line parses, and every prompt and
completion fits the rollout's and the packer's token budgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from opd.backends import check_model_dir
from opd.chat import ChatFormat
from opd.config import Config, ModelConfig
from opd.data import (
    OverBudgetError,
    completion_trajectory,
    numbered_records,
    prompt_record,
    tools_at_turn,
)
from opd.errors import DatasetError, MissingFileError, OPDError, VocabularyError
from opd.trajectory import AgentTrajectory

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class RunInputs:
    """The checked inputs of a run: what the trainer and the evals read."""

    chat: ChatFormat
    vocab_size: int  # the vocabulary the loss compares over (see check_vocabulary)
    prompts: list[dict]
    completions: list[AgentTrajectory] = field(default_factory=list)  # rendered once
    eval_records: list[dict] = field(default_factory=list)


def load_inputs(config: Config) -> RunInputs:
    """The run's tokenizer, chat format and datasets, each checked against the config."""
    for key in ("model.student", "model.teacher"):
        if getattr(config.model, key.split(".")[1]):  # no teacher: SFT or pure RL
            check_model_dir(getattr(config.model, key.split(".")[1]), key)
    chat = chat_format(config.tokenizer_path, config.model, config.model.student,
                       "model.tokenizer" if config.model.tokenizer else "model.student")
    vocab_size = check_vocabulary(config.model, chat.tokenizer)
    limit = config.rollout.max_total_len
    inputs = RunInputs(chat=chat, vocab_size=vocab_size,
                       prompts=load_prompts(config.data.prompts, chat, limit, "data.prompts"))
    if config.loss.off_policy_fraction > 0 or config.eval.baseline != "none":
        inputs.completions = load_completions(config.data.completions, chat,
                                              config.train.micro_batch_tokens)
    if config.data.eval and (config.eval.every or config.eval.before or config.eval.after):
        inputs.eval_records = load_prompts(config.data.eval, chat, limit,
                                           "data.eval")[:config.eval.limit or None]
    return inputs


def chat_format(tokenizer_path: str, model: ModelConfig, model_path: str,
                key: str) -> ChatFormat:
    """The tokenizer at `tokenizer_path` (named by `key`) with the recipe's template arguments
    and the stop ids of the model at `model_path` (its generation_config.json, if any)."""
    from transformers import AutoTokenizer, GenerationConfig

    if not any((Path(tokenizer_path) / name).is_file() for name in TOKENIZER_FILES):
        raise MissingFileError(f"{key}: {tokenizer_path} holds no tokenizer "
                               f"({' or '.join(TOKENIZER_FILES)}).")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    generation = GenerationConfig.from_pretrained(model_path) \
        if (Path(model_path) / "generation_config.json").is_file() else None
    return ChatFormat(tokenizer, model.chat_template_kwargs, generation)


def load_prompts(path: str, chat: ChatFormat, max_total_len: int, key: str) -> list[dict]:
    """Dataset records whose prompts leave room to generate under `rollout.max_total_len`."""
    records = []
    for line, record in numbered_records(path):
        prompt = prompt_record(record)
        try:
            length = len(chat.prompt_ids(prompt["messages"], tools_at_turn(
                prompt.get("tools"), prompt.get("tools_by_turn"), 0)))
        except OPDError as error:
            raise DatasetError(f"{path} line {line} ({key}): {error}") from None
        if length >= max_total_len:
            raise DatasetError(
                f"{path} line {line} ({key}): the prompt is {length} tokens, which leaves no "
                f"room to generate under rollout.max_total_len={max_total_len}; raise "
                "rollout.max_total_len or shorten the prompt.")
        records.append(record)
    return records


def load_completions(path: str, chat: ChatFormat, micro_batch_tokens: int
                     ) -> list[AgentTrajectory]:
    """Whole conversations rendered as the rollout would hold them, each within one
    micro-batch (`train.micro_batch_tokens`)."""
    trajectories = []
    for line, record in numbered_records(path):
        try:
            trajectory = completion_trajectory(chat, record["messages"], record.get("tools"),
                                               record.get("tools_by_turn"), micro_batch_tokens)
        except OverBudgetError as error:
            raise DatasetError(
                f"{path} line {line} (data.completions): {error}, more than "
                f"train.micro_batch_tokens={micro_batch_tokens}; raise "
                "train.micro_batch_tokens or drop the line.") from None
        except OPDError as error:
            raise DatasetError(f"{path} line {line} (data.completions): {error}") from None
        trajectories.append(trajectory)
    return trajectories


def check_vocabulary(model: ModelConfig, tokenizer) -> int:
    """The vocabulary size the loss compares over; `VocabularyError` names the key at fault.

    Sizes may differ by embedding padding (rows past the tokenizer's last id, never sampled),
    as Qwen checkpoints do (151,936 vs 152,064); the shared size is the smaller one. A model
    directory that ships its own tokenizer must ship the run's.
    """
    tokens = len(tokenizer)
    source = f"model.tokenizer ({model.tokenizer})" if model.tokenizer \
        else f"the student's tokenizer ({model.student})"
    sizes = {}
    for key in ("model.student", "model.teacher"):
        path = getattr(model, key.split(".")[1])
        if not path:  # no teacher: SFT or pure RL
            continue
        sizes[key] = _vocab_size(path)
        if sizes[key] < tokens:
            raise VocabularyError(
                f"{key}: the vocabulary of {path} has {sizes[key]} entries, fewer than the "
                f"{tokens} tokens of {source}; both models must cover the tokenizer.")
        own = _tokenizer_at(path) if Path(path) != Path(model.tokenizer or model.student) \
            else None
        if own is not None and own.get_vocab() != tokenizer.get_vocab():
            raise VocabularyError(
                f"{key}: the tokenizer in {path} differs from {source}; on-policy distillation "
                "compares next-token distributions over one shared vocabulary (set "
                "model.tokenizer to the one both models use, or leave it empty for the "
                "student's).")
    return min(sizes.values())


def _vocab_size(path: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return int(config.get_text_config().vocab_size)


def _tokenizer_at(path: str):
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
