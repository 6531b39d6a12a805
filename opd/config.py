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
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from opd import divergences
from opd.errors import ConfigError
from opd.sampling import SAMPLERS
from opd.teachers import TEACHERS

OVERRIDE_SOURCE = "command line"
PREPARED = "{prepared}"

# Bounds of the `tools.*` keys; the tool executor (opd.tools) enforces the same numbers.
MIN_RESULT_CHARS = 64  # an {"error": ...} observation must fit
MIN_MEMORY_LIMIT_MB = 32  # below this a worker cannot unpickle a call
MAX_CALLS_PER_TURN = 8  # the default of tools.max_calls_per_turn


WandbMode = Literal["offline", "online", "disabled"]


def rule(ok: Callable[[Any], bool], must: str, default: Any = MISSING, *,
         factory: Callable[[], Any] | None = None) -> Any:
    """A field whose value must pass `ok`; `must` completes "key must be ..." in the error."""
    if factory is not None:
        return field(metadata={"rule": (ok, must)}, default_factory=factory)
    return field(metadata={"rule": (ok, must)}, default=default)


def at_least(bound: float, default: Any, note: str = "") -> Any:
    return rule(lambda v: v >= bound, f"at least {bound:g}{note}", default)


def positive(default: Any) -> Any:
    return rule(lambda v: v > 0, "positive", default)


def within(low: float, high: float, default: Any, *, open_low: bool = False) -> Any:
    if open_low:
        return rule(lambda v: low < v <= high, f"in ({low:g}, {high:g}]", default)
    return rule(lambda v: low <= v <= high, f"in [{low:g}, {high:g}]", default)


@dataclass
class ModelConfig:
    student: str = ""  # Hugging Face model directory
    teacher: str = ""
    # Empty: the student's directory. Reset to empty when a later source (a cluster file, the
    # command line) names another student or teacher, so a recipe's tokenizer never outlives
    # the models it was written for.
    tokenizer: str = ""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """JSONL datasets, one conversation per line (opd.data)."""

    prompts: str = ""  # OPD prompts (a line's messages before its first assistant turn)
    completions: str = ""  # whole conversations for off-policy steps (loss.off_policy_fraction)
    eval: str = ""  # held-out tasks with gold answers; empty: no eval


@dataclass
class RolloutConfig:
    """Sampling limits of one rollout phase; opd.rollout takes it as it is."""

    max_turns: int = at_least(1, 3)
    max_new_tokens: int = at_least(1, 256)
    max_total_len: int = at_least(2, 2048)
    temperature: float = positive(1.0)
    top_p: float = within(0, 1, 1.0, open_low=True)
    top_k: int = at_least(0, 0)
    batch_size: int = at_least(1, 32)  # conversations sampled together on one rank
    # Episodes sampled per prompt (a group: its rewards are normalised together, opd.rewards);
    # each rank samples the whole group of each of its prompts.
    samples_per_prompt: int = at_least(1, 1)
    # A sampler registered in opd.sampling. hf: our batched decode loop (the reference); vllm: a
    # colocated vLLM engine per rank (opd.sampling.vllm; the extra requirements-vllm-*.txt).
    engine: str = rule(lambda v: v in SAMPLERS, f"one of {', '.join(SAMPLERS)}", "hf")
    # vLLM's share of the accelerator's memory for weights and KV cache (GPU only).
    gpu_memory_utilization: float = within(0, 1, 0.3, open_low=True)
    # vLLM only, same trajectories either way. conversation: a conversation's next turn starts
    # as soon as its tools return, tools run while the engine generates; rounds: every turn of
    # a round, then every tool call, then the next round (the reference; on CPU the two are
    # within noise unless tools are slow, see BENCHMARKS.md).
    vllm_schedule: Literal["conversation", "rounds"] = "conversation"
    # vLLM only: ranks per engine. 1: an engine per rank. N > 1: each N consecutive ranks (of one
    # node) share one engine, sharded by tensor parallelism, for a student that does not fit one
    # device beside its training states; the group's first rank runs the rollout of all the
    # group's prompts (and their tool calls) and hands each rank its share.
    vllm_tensor_parallel_size: int = at_least(1, 1)

    def validate(self) -> None:
        """Raise `ConfigError` naming the first `rollout.*` key out of bounds."""
        try:
            check_rules(self, "rollout.")
        except ConfigError as error:  # in the seed's words for the same mistake
            raise ConfigError(f"Generation limits and temperature must be positive: {error}") \
                from None


@dataclass
class ToolsConfig:
    registry: str = ""  # module:function -> opd.tool_schemas.ToolRegistry; empty: no tools
    # module:Class of a stateful environment (opd.environments), one per conversation, built
    # from the record's "environment"; empty: the stateless tools of `registry`.
    environment: str = ""
    parser: str = "hermes"  # a registered parser name or module:function(text) -> [ToolCall]
    timeout_s: float = positive(10.0)
    num_workers: int = at_least(1, 2)
    max_result_chars: int = at_least(MIN_RESULT_CHARS, 2048, " (an error observation must fit)")
    memory_limit_mb: int = at_least(MIN_MEMORY_LIMIT_MB, 1024)
    # Calls past this many in one assistant turn get an error observation and never run.
    max_calls_per_turn: int = at_least(1, MAX_CALLS_PER_TURN)
    # Environment variables tools may read; the sandbox passes no other (API keys stay out).
    pass_env: list[str] = field(default_factory=list)


@dataclass
class LossConfig:
    """The training loss; opd.divergences declares the directions, opd.loss_sampled's docstring
    gives the sampled_reverse_kl formulas that the keys after `off_policy_fraction` enter."""

    # A name in opd.divergences: forward_kl, reverse_kl, jsd (full vocabulary), sft (the
    # cross-entropy of data.completions' tokens, no teacher), sampled_reverse_kl (policy-gradient
    # form from the teacher's log-prob of each sampled token, plus an optional task reward),
    # hybrid_kl (forward KL where the teacher is confident, reverse KL elsewhere).
    direction: str = rule(lambda v: v in divergences.REGISTRY,
                          f"one of {', '.join(divergences.NAMES)}", "forward_kl")
    beta: float = within(0, 1, 0.5)  # generalised JSD mix: 0 = forward KL, 1 = reverse KL
    # hybrid_kl only: a target token whose teacher gives its top token at least this probability
    # (at loss.temperature) trains on forward KL, any other on reverse KL; 0 is forward_kl.
    forward_kl_above: float = within(0, 1, 0.9)
    temperature: float = positive(1.0)
    chunk_size: int = at_least(0, 0)  # target tokens per [chunk, vocab] block; 0: ~12.6M logits
    # On-policy only: train none of the student's tokens after its Nth refused call (0: all of
    # them). 1: where the student cannot learn the teacher's recovery, the states after a refusal
    # dominate the loss and undo its first-try calls; 2: the turn after the first refusal (the
    # recovery the teacher scores) trains, a loop of refusals does not (README, "Where on-policy
    # distillation pays").
    mask_after_refusals: int = at_least(0, 0)
    # Fraction of steps trained on dataset completions instead of the student's own samples:
    # the complement of GKD's (and TRL's) lambda, which is the on-policy fraction.
    off_policy_fraction: float = within(0, 1, 0.0)
    # sampled_reverse_kl only (any other direction refuses a value other than the default):
    # k1: advantage -(log p - log q), the reverse-KL gradient in expectation; k3: the k3 estimate
    # as a loss through log p, whose gradient is the FORWARD KL's in expectation.
    kl_estimator: Literal["k1", "k3"] = "k1"
    # Weight of the teacher term; 0 with reward_weight > 0 is pure RL (no teacher is started).
    distill_weight: float = at_least(0, 1.0)
    reward_weight: float = at_least(0, 0.0)  # weight of the task reward's advantage
    # Truncated importance weights min(p_learner / p_sampler, cap) on each sampled token; 0: off.
    importance_cap: float = rule(lambda v: v == 0 or v >= 1, "0 (off) or at least 1", 0.0)
    advantage_clip: float = at_least(0, 0.0, " (0 disables clipping)")  # |per-token advantage|
    # Rewards of one prompt's samples -> advantages (opd.rewards): mean_std (GRPO), mean,
    # leave_one_out (RLOO), none (the raw reward).
    advantage_norm: Literal["mean_std", "mean", "leave_one_out", "none"] = "mean_std"

    def problem(self) -> tuple[str, str] | None:
        """(key, sentence) of the first rule across this section's keys that fails, or None."""
        if self.direction != "hybrid_kl" and self.forward_kl_above != LossConfig.forward_kl_above:
            return ("loss.forward_kl_above", f"loss.forward_kl_above applies only to "
                    f"loss.direction=hybrid_kl; leave it at {LossConfig.forward_kl_above!r} with "
                    f"loss.direction={self.direction}.")
        if self.direction != "sampled_reverse_kl":
            defaults = LossConfig(direction="sampled_reverse_kl")
            for key in SAMPLED_ONLY_KEYS:
                if getattr(self, key) != getattr(defaults, key):
                    return (f"loss.{key}", f"loss.{key} applies only to loss.direction="
                            f"sampled_reverse_kl (a full-vocabulary or sft loss takes no task "
                            f"reward or sampled-token options); leave it at "
                            f"{getattr(defaults, key)!r} with loss.direction={self.direction}.")
        elif self.off_policy_fraction > 0:
            return ("loss.off_policy_fraction", "loss.off_policy_fraction must be 0 with "
                    "loss.direction=sampled_reverse_kl: its estimator needs tokens the student "
                    "sampled, and dataset completions are not.")
        if self.distill_weight == 0 and self.reward_weight == 0:
            return ("loss.distill_weight", "loss.distill_weight and loss.reward_weight are both "
                    "0, so nothing would be trained; set one of them above 0.")
        return None

    @property
    def needs_teacher(self) -> bool:
        """A teacher engine is started only when the loss reads one (not sft, not pure RL)."""
        return divergences.get(self.direction).needs_teacher and self.distill_weight > 0


SAMPLED_ONLY_KEYS = ("kl_estimator", "distill_weight", "reward_weight", "importance_cap",
                     "advantage_clip", "advantage_norm")


@dataclass
class OptimConfig:
    lr: float = positive(1e-5)
    weight_decay: float = at_least(0, 0.0)
    betas: list[float] = rule(lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
                              "two numbers in [0, 1)", factory=lambda: [0.9, 0.95])
    eps: float = positive(1e-8)
    grad_clip: float = at_least(0, 1.0, " (0 disables clipping)")
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = at_least(0, 0)
    min_lr_ratio: float = within(0, 1, 0.1)  # floor of the decay, as a fraction of lr


@dataclass
class TrainConfig:
    steps: int = at_least(1, 100)  # optimizer steps
    prompts_per_step: int = at_least(1, 64)  # global: split across data-parallel ranks
    micro_batch_tokens: int = at_least(2, 8192)  # varlen packing budget per micro-batch
    # A step whose loss or gradient norm is not finite never reaches the optimizer: `skip` logs
    # it and goes on (up to max_nonfinite_steps in a row, then stops); `stop` stops at once.
    nonfinite: Literal["skip", "stop"] = "skip"
    max_nonfinite_steps: int = at_least(1, 10)


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
    # A teacher registered in opd.teachers (in-process: zero_inference, tensor_parallel,
    # replicated; served: a teacher server, see teacher.urls).
    engine: str = rule(lambda v: v in TEACHERS, f"one of {', '.join(TEACHERS)}",
                       "zero_inference")
    # What the teacher returns (opd.teachers.base): auto is what loss.direction needs;
    # distribution (exact), topk (teacher.top_k ids and log-probs plus the rest's mass) or
    # sampled (the sampled tokens' log-probs only).
    signal: Literal["auto", "distribution", "topk", "sampled"] = "auto"
    top_k: int = at_least(1, 20)  # signal=topk
    # micro_batch: score the packed micro-batches inside the step (in-process engines);
    # conversation: score each finished conversation at collect time, as a served teacher does.
    scoring: Literal["micro_batch", "conversation"] = "micro_batch"
    deepspeed_config: str = "configs/deepspeed/zero_inference.json"
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str = ""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # tensor_parallel: ranks per teacher copy; served: GPUs per teacher server in a Slurm job with
    # cluster.teacher_nodes; 0: the ranks (GPUs) of one node, each node its own copy
    tp_size: int = at_least(0, 0)
    # served: the teacher servers (python -m opd.teachers.server), one URL per replica, e.g.
    # [http://127.0.0.1:8800]; each rank sends its conversations round-robin over them.
    urls: list[str] = field(default_factory=list)
    timeout_s: float = positive(120.0)  # served: one scoring request, before it is retried
    retries: int = at_least(0, 3)  # served: further tries of a request (the next replica each)
    startup_timeout_s: float = positive(900.0)  # served: how long to wait for /health
    in_flight: int = at_least(1, 4)  # served: requests in flight per replica and rank
    # served, started by the Slurm job (cluster.teacher_nodes): the servers' engine options.
    quantization: Literal["none", "fp8"] = "none"  # fp8: vLLM quantizes the weights at load
    expert_parallel: bool = False  # a MoE teacher's experts split over its GPUs, not sliced
    gpu_memory_utilization: float = rule(lambda v: 0 < v <= 1, "in (0, 1]", 0.9)
    # served: send each conversation for scoring as soon as its rollout ends, while the others
    # still generate or wait for tools (false: all of them once the rollout is done)
    overlap: bool = True


@dataclass
class CheckpointConfig:
    every: int = at_least(0, 0)  # optimizer steps between checkpoints; 0: only at the end
    keep: int = at_least(1, 2)  # newest checkpoints kept
    resume: str = "auto"  # auto: newest in the run directory | never | a checkpoint directory


@dataclass
class LoggingConfig:
    run_dir: str = ""  # empty: runs/<name>
    wandb_mode: WandbMode = "offline"
    wandb_project: str = "opd-recipes"
    progress: bool = True


@dataclass
class EvalConfig:
    every: int = at_least(0, 0)  # optimizer steps between evals during training; 0: none
    before: bool = True
    after: bool = True
    teacher: bool = True  # also evaluate the teacher (the table's first row)
    limit: int = at_least(0, 0)  # held-out examples; 0: all
    checker: str = ""  # module:function(final_text, record) -> bool; needed with data.eval
    # A control arm trained after the run and printed as its own row, so the table shows what
    # the recipe bought over the cheaper thing: the same warm student, steps, optimizer and batch
    # on data.completions only, by their tokens' cross-entropy ("sft", no teacher) or the
    # teacher's full distribution on them ("kd", forward KL). "none": no control arm.
    baseline: Literal["none", "sft", "kd"] = "none"


@dataclass
class SlurmConfig:
    """sbatch options of a cluster, read by launch/submit.py only (empty: Slurm's default)."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = rule(lambda v: bool(v.strip()), "a time limit such as 12:00:00", "01:00:00")
    gpus_per_node: int = at_least(0, 0)
    cpus_per_node: int = at_least(0, 0)
    mem: str = ""
    exclusive: bool = False
    constraint: str = ""
    # USR1 this long before the time limit: checkpoint and requeue
    signal_seconds: int = at_least(0, 120, " (0: no warning signal)")
    requeue: bool = True
    setup: list[str] = field(default_factory=list)  # shell lines run before srun
    python: str = ""  # the nodes' interpreter; empty: the one running submit.py
    env: dict[str, Any] = rule(  # exported before srun
        lambda env: all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k))
                        and isinstance(v, (str, int, float)) and not isinstance(v, bool)
                        for k, v in env.items()),
        "a mapping of environment variable names to strings or numbers", factory=dict)
    sbatch_args: list[str] = field(default_factory=list)  # further options, verbatim


@dataclass
class ClusterConfig:
    name: str = "local-cpu"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    threads_per_rank: int = at_least(0, 0)  # torch CPU threads per rank; 0: cores / local ranks
    # Collective timeout once the first step passed (before it: 60 min, for loading and compiling):
    # how long ranks wait for one that stopped responding before the run fails.
    collective_timeout_s: float = positive(300.0)
    nodes: int = at_least(1, 1)  # the layout a launcher will start (for --dry-run before launch)
    procs_per_node: int = at_least(1, 1)
    # teacher.engine=served through launch/submit.py: nodes of the job, beside `nodes`, that run
    # the teacher servers (nodes x GPUs / teacher.tp_size replicas); 0: the servers run elsewhere
    # and teacher.urls names them.
    teacher_nodes: int = at_least(0, 0)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class Config:
    name: str = "run"
    seed: int = at_least(0, 0)
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

    @property
    def teacher_signal(self) -> str:
        """What the teacher returns: `teacher.signal`, or what `loss.direction` reads."""
        return self.teacher.signal if self.teacher.signal != "auto" \
            else divergences.get(self.loss.direction).signal


# Keys that no longer exist: what to write instead, in one sentence.
RENAMED = {
    "loss.gkd_lambda": "loss.gkd_lambda was renamed loss.off_policy_fraction (the fraction of "
                       "steps trained on dataset completions); GKD's and TRL's lambda is the "
                       "on-policy fraction, so lambda=0.9 is off_policy_fraction=0.1",
    "loss.mask_after_refused_call": "loss.mask_after_refused_call was replaced by "
                                    "loss.mask_after_refusals, a count: true is 1 (no target "
                                    "after the first refused call), false is 0",
}


def teacher_signal_problem(config: Config) -> str | None:
    """Why `teacher.signal` cannot feed `loss.direction`, or None."""
    wanted, entry = config.teacher.signal, divergences.get(config.loss.direction)
    if wanted == "auto" or wanted == entry.signal:
        return None
    if not config.loss.needs_teacher:
        return (f"teacher.signal={wanted} needs a teacher, and loss.direction="
                f"{config.loss.direction} with loss.distill_weight={config.loss.distill_weight:g} "
                "starts none; leave teacher.signal=auto.")
    if wanted == "topk" and entry.signal == "distribution":
        return None if entry.topk else f"teacher.signal=topk: {entry.topk_refusal}."
    return (f"teacher.signal={wanted} cannot feed loss.direction={config.loss.direction}, which "
            f"reads the teacher's {entry.signal} signal; use teacher.signal=auto or "
            f"{entry.signal}.")


def load_config(recipe: str | Path | None = None, cluster: str | Path | None = None,
                overrides: Sequence[str] = (), *, complete: bool = True) -> Config:
    """The resolved config of a run; `ConfigError` names the key and source of any problem.

    `complete=False` checks each value but not that a run's required keys are set (a config
    for `python -m opd.eval`, which needs no teacher or prompts).
    """
    merged: dict = {}
    sources: dict[str, str] = {}
    layers = [(_read_yaml(path), str(path)) for path in (recipe, cluster) if path is not None]
    layers += [(parse_override(override), OVERRIDE_SOURCE) for override in overrides]
    for position, (layer, source) in enumerate(layers):
        model = layer.get("model")
        if isinstance(model, dict) and {"student", "teacher"} & set(model) \
                and "tokenizer" not in model and merged.get("model", {}).get("tokenizer"):
            # Another pair of models: the earlier source's tokenizer was written for its own.
            merged["model"]["tokenizer"] = ""
            sources["model.tokenizer"] = source
        _merge(merged, layer, source, sources)
    config = _build(Config, merged, "", sources)
    if complete:
        check(config, sources)
    else:
        check_rules(config, "", sources)
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
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text (a binary or differently encoded "
                          "file?).") from None
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
        if f"{prefix}{key}" in RENAMED:
            raise ConfigError(f"{_where(f'{prefix}{key}', sources)}: {RENAMED[f'{prefix}{key}']}.")
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
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
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
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}[hint]


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
        if _has_nonfinite(value):
            raise ConfigError(f"{_where(dotted, sources)}: {dotted} must hold finite numbers "
                              f"only, got {value!r}.")
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
                number = float(value)
            except ValueError:
                raise bad() from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        else:
            number = float(value)
        if not math.isfinite(number):  # inf passes every bound, nan fails none
            raise bad()
        return number
    if hint is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise bad()
        return value
    raise TypeError(f"unsupported config type {hint} ({dotted})")


def _has_nonfinite(value: Any) -> bool:
    """Whether a YAML value holds inf or nan anywhere (.inf passes every bound a rule sets)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_nonfinite(item) for item in value.values())
    if isinstance(value, list):
        return any(_has_nonfinite(item) for item in value)
    return False


def check_rules(section: Any, prefix: str = "", sources: dict[str, str] | None = None) -> None:
    """The `rule` of every field of `section` and the sections inside it (see `rule`)."""
    for item in dataclasses.fields(section):
        value, dotted = getattr(section, item.name), f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            check_rules(value, f"{dotted}.", sources)
        elif "rule" in item.metadata:
            ok, must = item.metadata["rule"]
            if not ok(value):
                where = f"{_where(dotted, sources)}: " if sources is not None else ""
                raise ConfigError(f"{where}{dotted} must be {must}, got {value!r}.")


def _get(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def check(config: Config, sources: dict[str, str] | None = None) -> None:
    """Every field's rule, then the rules across sections; `ConfigError` names key and source."""
    sources = sources or {}
    check_rules(config, "", sources)

    def fail(key: str, sentence: str) -> ConfigError:
        return ConfigError(f"{_where(key, sources)}: {sentence}")

    # Pure RL (loss.distill_weight=0) and SFT need no teacher; one named is still evaluated.
    teacher_read = config.loss.needs_teacher or config.eval.baseline == "kd"
    needed = ("model.student", *(("model.teacher",) if teacher_read else ()),
              "data.prompts")
    for key in needed:
        if not _get(config, key):
            raise fail(key, f"{key} is not set; the recipe must name it.")
    if config.train.micro_batch_tokens < config.rollout.max_total_len:
        raise fail("train.micro_batch_tokens",
                   f"train.micro_batch_tokens={config.train.micro_batch_tokens} must be at least "
                   f"rollout.max_total_len={config.rollout.max_total_len}, so the longest "
                   "conversation fits one micro-batch.")
    loss_problem = config.loss.problem()
    if loss_problem is not None:
        raise fail(*loss_problem)
    signal_problem = teacher_signal_problem(config)
    if signal_problem is not None:
        raise fail("teacher.signal", signal_problem)
    if config.loss.reward_weight > 0 and config.rollout.samples_per_prompt == 1 \
            and config.loss.advantage_norm != "none":
        raise fail("rollout.samples_per_prompt", "loss.reward_weight > 0 with loss.advantage_norm="
                   f"{config.loss.advantage_norm} needs rollout.samples_per_prompt of at least 2: "
                   "a group of one has no baseline, so every advantage would be 0.")
    if config.loss.reward_weight > 0 and not config.eval.checker:
        raise fail("eval.checker", "loss.reward_weight > 0 needs eval.checker: the world's "
                   "checker scores each episode into its reward.")
    if config.loss.direction == "sft" and config.loss.off_policy_fraction != 1:
        raise fail("loss.off_policy_fraction", "loss.direction=sft trains on data.completions "
                   "only, so loss.off_policy_fraction must be 1.")
    if config.loss.off_policy_fraction > 0 and not config.data.completions:
        raise fail("data.completions", "data.completions must name a dataset of whole "
                   "conversations when loss.off_policy_fraction > 0.")
    baseline_lacks = [key for key in ("data.completions", "data.eval", "eval.after")
                      if not _get(config, key)]
    if config.eval.baseline != "none" and baseline_lacks:
        raise fail(baseline_lacks[0], f"eval.baseline={config.eval.baseline} trains a control "
                   "arm on data.completions and evaluates it beside the trained student on "
                   f"data.eval, so {baseline_lacks[0]} must be set (or eval.baseline=none).")
    if config.data.eval and not config.eval.checker:
        raise fail("eval.checker", "eval.checker must name a module:function(final_text, "
                   "record) -> bool when data.eval is set (e.g. worlds.toolcalc.tasks:"
                   "check_answer).")
    if config.eval.every and config.student.generation_gather != "once":
        raise fail("eval.every", "eval.every needs student.generation_gather=once (rank 0 "
                   "evaluates the gathered student).")
    if config.teacher.offload_param == "nvme" and not config.teacher.nvme_path:
        raise fail("teacher.nvme_path", "teacher.nvme_path must name a directory when "
                   "teacher.offload_param is nvme.")
    if config.teacher.engine != "zero_inference" and config.teacher.offload_param != "none":
        raise fail("teacher.offload_param", "teacher.offload_param only applies to "
                   "teacher.engine=zero_inference.")
    served_only = [key for key, unset in (
        ("cluster.teacher_nodes", config.cluster.teacher_nodes == 0),
        ("teacher.quantization", config.teacher.quantization == "none"),
        ("teacher.expert_parallel", not config.teacher.expert_parallel)) if not unset]
    if served_only and config.teacher.engine != "served":
        raise fail(served_only[0], f"{served_only[0]} configures teacher servers and needs "
                   f"teacher.engine=served, not {config.teacher.engine}.")
