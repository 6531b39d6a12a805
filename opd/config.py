"""Typed run configuration: a YAML recipe, a cluster file and dotted command-line overrides.

Later sources win: dataclass defaults < recipe < cluster file < `key=value` overrides. A cluster
file holds a `cluster:` section and may override any recipe section (a cluster with little GPU
memory turns on `student.offload_optimizer: cpu`, say). Every key and value is checked against
the dataclasses below, and a bad one stops the run with one sentence naming the key and the
file it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

OVERRIDE_SOURCE = "command line"
PREPARED = "{prepared}"


class ConfigError(ValueError):
    """A recipe, cluster file or override that cannot be used; the message names key and file."""


@dataclass
class ModelConfig:
    student: str = ""  # Hugging Face model directory
    teacher: str = ""
    tokenizer: str = ""  # empty: the student's directory
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """JSONL datasets, one conversation per line (opd.data)."""

    prompts: str = ""  # OPD prompts (a line's messages before its first assistant turn)
    completions: str = ""  # whole conversations for GKD off-policy steps (loss.gkd_lambda > 0)
    eval: str = ""  # held-out tasks with gold answers; empty: no eval


@dataclass
class RolloutConfig:
    """Sampling limits of one rollout phase; opd.rollout takes it as it is."""

    max_turns: int = 3
    max_new_tokens: int = 256
    max_total_len: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 32  # conversations sampled together on one rank

    def validate(self) -> None:
        if min(self.max_turns, self.max_new_tokens, self.max_total_len, self.batch_size) < 1:
            raise ValueError("Generation limits and temperature must be positive "
                             "(rollout.max_turns, max_new_tokens, max_total_len, batch_size >= 1)")
        if self.temperature <= 0:
            raise ValueError("Generation limits and temperature must be positive "
                             f"(rollout.temperature={self.temperature})")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"rollout.top_p must be in (0, 1] and rollout.top_k >= 0 "
                             f"(got top_p={self.top_p}, top_k={self.top_k})")


@dataclass
class ToolsConfig:
    registry: str = "opd.tools:builtin_registry"  # module:function returning a ToolRegistry
    parser: str = "hermes"
    timeout_s: float = 10.0
    num_workers: int = 2
    max_result_chars: int = 2048
    memory_limit_mb: int = 1024


@dataclass
class LossConfig:
    direction: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = 0.5  # generalised JSD mix: 0 = forward KL, 1 = reverse KL
    temperature: float = 1.0
    chunk_size: int = 0  # target tokens per [chunk, vocab] block; 0: ~12.6M logits per block
    gkd_lambda: float = 0.0  # fraction of steps trained on dataset completions (off-policy)


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # floor of the decay, as a fraction of lr


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    prompts_per_step: int = 64  # global: split across data-parallel ranks
    micro_batch_tokens: int = 8192  # varlen packing budget per micro-batch


@dataclass
class StudentConfig:
    backend: Literal["deepspeed", "fsdp"] = "deepspeed"
    deepspeed_config: str = "configs/deepspeed/zero3.json"
    offload_optimizer: Literal["none", "cpu"] = "none"
    offload_param: Literal["none", "cpu"] = "none"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    gradient_checkpointing: bool = False
    # once: gather the whole student for a rollout phase; per_step: every forward gathers layer
    # by layer (when the whole student does not fit on one device).
    generation_gather: Literal["once", "per_step"] = "once"


@dataclass
class TeacherConfig:
    engine: Literal["zero_inference", "tensor_parallel", "replicated"] = "zero_inference"
    deepspeed_config: str = "configs/deepspeed/zero_inference.json"
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str = ""
    precision: Literal["auto", "fp32", "bf16"] = "auto"


@dataclass
class CheckpointConfig:
    every: int = 0  # optimizer steps between checkpoints; 0: only at the end
    keep: int = 2  # newest checkpoints kept
    resume: str = "auto"  # auto: newest in the run directory | never | a checkpoint directory


@dataclass
class LoggingConfig:
    run_dir: str = ""  # empty: runs/<name>
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "opd-recipes"
    progress: bool = True


@dataclass
class EvalConfig:
    every: int = 0  # optimizer steps between evals during training; 0: none
    before: bool = True
    after: bool = True
    teacher: bool = True  # also evaluate the teacher (the table's first row)
    limit: int = 0  # held-out examples; 0: all
    checker: str = "recipes.toolcalc.tasks:check_answer"  # module:function(final_text, record)


@dataclass
class SlurmConfig:
    """sbatch options of a cluster, read by launch/submit.py only (empty: Slurm's default)."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = "01:00:00"
    gpus_per_node: int = 0
    cpus_per_node: int = 0
    mem: str = ""
    exclusive: bool = False
    constraint: str = ""
    signal_seconds: int = 120  # USR1 this long before the time limit: checkpoint and requeue
    requeue: bool = True
    setup: list[str] = field(default_factory=list)  # shell lines run before srun
    python: str = ""  # the nodes' interpreter; empty: the one running submit.py
    env: dict[str, Any] = field(default_factory=dict)  # exported before srun
    sbatch_args: list[str] = field(default_factory=list)  # further options, verbatim


@dataclass
class ClusterConfig:
    name: str = "local-cpu"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    threads_per_rank: int = 0  # torch CPU threads per rank; 0: the host's cores / local ranks
    # Collective timeout once the first step passed (before it: 60 min, for loading and compiling):
    # how long ranks wait for one that stopped responding before the run fails.
    collective_timeout_s: float = 300.0
    nodes: int = 1  # the layout a launcher will start (for --dry-run before launch)
    procs_per_node: int = 1
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class Config:
    name: str = "run"
    seed: int = 0
    # module:function run once (and cached by it) before training; it returns the directory
    # that "{prepared}" stands for in any path of the config. Called with build=False it returns
    # the cached directory or None without building (--dry-run). Empty: no prepare step.
    prepare: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir or f"runs/{self.name}")

    @property
    def tokenizer_path(self) -> str:
        return self.model.tokenizer or self.model.student


def load_config(recipe: str | Path | None = None, cluster: str | Path | None = None,
                overrides: list[str] = ()) -> Config:
    """The resolved config of a run; `ConfigError` names the key and source of any problem."""
    merged: dict = {}
    sources: dict[str, str] = {}
    if recipe is not None:
        _merge(merged, _read_yaml(recipe), str(recipe), sources)
    if cluster is not None:
        _merge(merged, _read_yaml(cluster), str(cluster), sources)
    for override in overrides:
        _merge(merged, parse_override(override), OVERRIDE_SOURCE, sources)
    config = _build(Config, merged, "", sources)
    check(config, sources)
    return config


def parse_override(text: str) -> dict:
    """`loss.direction=reverse_kl` -> {"loss": {"direction": "reverse_kl"}} (YAML-typed value)."""
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"Override {text!r} on the command line must look like "
                          "section.key=value (e.g. loss.direction=reverse_kl).")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    nested: Any = parsed
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return nested


def with_prepared(config: Config, root: str | Path) -> Config:
    """`config` with every "{prepared}" in its string values replaced by `root`."""
    def walk(node):
        if dataclasses.is_dataclass(node):
            return dataclasses.replace(node, **{f.name: walk(getattr(node, f.name))
                                                for f in dataclasses.fields(node)})
        if isinstance(node, str):
            return node.replace(PREPARED, str(root))
        return node
    return walk(config)


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where} is not valid YAML.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config sections, not a "
                          f"{type(data).__name__}.")
    return data


def _merge(into: dict, update: dict, source: str, sources: dict[str, str],
           prefix: str = "") -> None:
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, source, sources, f"{dotted}.")
        else:
            into[key] = value
        _record_sources(value, dotted, source, sources)


def _record_sources(value: Any, dotted: str, source: str, sources: dict[str, str]) -> None:
    sources[dotted] = source
    if isinstance(value, dict):
        for key, inner in value.items():
            _record_sources(inner, f"{dotted}.{key}", source, sources)


def _where(dotted: str, sources: dict[str, str]) -> str:
    while dotted:
        if dotted in sources:
            return sources[dotted]
        dotted = dotted.rpartition(".")[0]
    return "defaults"


def _build(cls: type, values: Any, prefix: str, sources: dict[str, str]):
    if not isinstance(values, dict):
        raise ConfigError(f"{_where(prefix.rstrip('.'), sources)}: {prefix.rstrip('.')} must be a "
                          f"mapping of keys, got {values!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            dotted = f"{prefix}{key}"
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else \
                f" (known keys: {', '.join(names)})"
            raise ConfigError(f"{_where(dotted, sources)}: unknown key '{dotted}'{hint}.")
    kwargs = {}
    for name in names:
        if name not in values:
            continue
        dotted = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, values[name], f"{dotted}.", sources)
        else:
            kwargs[name] = _coerce(values[name], hint, dotted, sources)
    return cls(**kwargs)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[hint]


def _coerce(value: Any, hint, dotted: str, sources: dict[str, str]):
    origin, args = typing.get_origin(hint), typing.get_args(hint)

    def bad():
        return ConfigError(f"{_where(dotted, sources)}: {dotted} must be {_describe(hint)}, "
                           f"got {value!r}.")

    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"config fields are not unions ({dotted})")
    if origin is Literal:
        if value not in args:
            raise bad()
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad()
        return [_coerce(item, args[0], dotted, sources) for item in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if hint is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise bad()
        return value
    raise TypeError(f"unsupported config type {hint} ({dotted})")


# (dotted key, predicate, what the value must be)
_RULES: list[tuple[str, typing.Callable[[Any], bool], str]] = [
    ("seed", lambda v: v >= 0, "at least 0"),
    ("rollout.max_turns", lambda v: v >= 1, "at least 1"),
    ("rollout.max_new_tokens", lambda v: v >= 1, "at least 1"),
    ("rollout.max_total_len", lambda v: v >= 2, "at least 2"),
    ("rollout.temperature", lambda v: v > 0, "positive"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout.top_k", lambda v: v >= 0, "at least 0"),
    ("rollout.batch_size", lambda v: v >= 1, "at least 1"),
    ("tools.timeout_s", lambda v: v > 0, "positive"),
    ("tools.num_workers", lambda v: v >= 1, "at least 1"),
    ("tools.max_result_chars", lambda v: v >= 16, "at least 16"),
    ("loss.beta", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("loss.temperature", lambda v: v > 0, "positive"),
    ("loss.chunk_size", lambda v: v >= 0, "at least 0"),
    ("loss.gkd_lambda", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.lr", lambda v: v > 0, "positive"),
    ("optim.weight_decay", lambda v: v >= 0, "at least 0"),
    ("optim.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("optim.eps", lambda v: v > 0, "positive"),
    ("optim.grad_clip", lambda v: v >= 0, "at least 0 (0 disables clipping)"),
    ("optim.warmup_steps", lambda v: v >= 0, "at least 0"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("train.steps", lambda v: v >= 1, "at least 1"),
    ("train.prompts_per_step", lambda v: v >= 1, "at least 1"),
    ("train.micro_batch_tokens", lambda v: v >= 2, "at least 2"),
    ("checkpoint.every", lambda v: v >= 0, "at least 0"),
    ("checkpoint.keep", lambda v: v >= 1, "at least 1"),
    ("eval.every", lambda v: v >= 0, "at least 0"),
    ("eval.limit", lambda v: v >= 0, "at least 0"),
    ("cluster.threads_per_rank", lambda v: v >= 0, "at least 0"),
    ("cluster.collective_timeout_s", lambda v: v > 0, "positive"),
    ("cluster.nodes", lambda v: v >= 1, "at least 1"),
    ("cluster.procs_per_node", lambda v: v >= 1, "at least 1"),
    ("cluster.slurm.gpus_per_node", lambda v: v >= 0, "at least 0"),
    ("cluster.slurm.cpus_per_node", lambda v: v >= 0, "at least 0"),
    ("cluster.slurm.signal_seconds", lambda v: v >= 0, "at least 0 (0: no warning signal)"),
    ("cluster.slurm.time", lambda v: bool(v.strip()), "a time limit such as 12:00:00"),
    ("cluster.slurm.env", lambda env: all(
        re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)) and isinstance(v, (str, int, float))
        and not isinstance(v, bool) for k, v in env.items()),
     "a mapping of environment variable names to strings or numbers"),
]


def _get(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def check(config: Config, sources: dict[str, str] | None = None) -> None:
    """Value rules that types cannot say; raises `ConfigError` naming the key and its source."""
    sources = sources or {}
    for dotted, ok, must in _RULES:
        value = _get(config, dotted)
        if not ok(value):
            raise ConfigError(f"{_where(dotted, sources)}: {dotted} must be {must}, got {value!r}.")
    for key in ("model.student", "model.teacher", "data.prompts"):
        if not _get(config, key):
            raise ConfigError(f"{_where(key, sources)}: {key} is not set; the recipe must name it.")
    if config.train.micro_batch_tokens < config.rollout.max_total_len:
        raise ConfigError(
            f"{_where('train.micro_batch_tokens', sources)}: train.micro_batch_tokens="
            f"{config.train.micro_batch_tokens} must be at least rollout.max_total_len="
            f"{config.rollout.max_total_len}, so the longest conversation fits one micro-batch.")
    if config.loss.gkd_lambda > 0 and not config.data.completions:
        raise ConfigError(f"{_where('data.completions', sources)}: data.completions must name a "
                          "dataset of whole conversations when loss.gkd_lambda > 0.")
    if config.eval.every and config.student.generation_gather != "once":
        raise ConfigError(f"{_where('eval.every', sources)}: eval.every needs "
                          "student.generation_gather=once (rank 0 evaluates the gathered student).")
    if config.teacher.offload_param == "nvme" and not config.teacher.nvme_path:
        raise ConfigError(f"{_where('teacher.nvme_path', sources)}: teacher.nvme_path must name a "
                          "directory when teacher.offload_param is nvme.")
    if config.teacher.engine != "zero_inference" and config.teacher.offload_param != "none":
        raise ConfigError(f"{_where('teacher.offload_param', sources)}: teacher.offload_param only "
                          "applies to teacher.engine=zero_inference.")
