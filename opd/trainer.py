"""The OPD loop: rollout -> pack -> teacher -> fused loss -> optimizer step.

One optimizer step:
1. Prompts: the step's slice of a seeded, epoch-wise shuffle of the prompt set, dealt round-robin
   to data-parallel ranks (or, with probability `loss.gkd_lambda`, the same slice of dataset
   completions: the GKD off-policy mix, decided identically on every rank).
2. Rollout under the student's generation context (gathered once, or gathered per forward with
   all ranks in lockstep).
3. Varlen packing into micro-batches; ranks agree on the micro-batch count (short ranks add
   empty ones) and on the global number of target tokens.
4. Per micro-batch: teacher hidden states, then the student's fused loss (sum over target tokens)
   scaled by world_size / global_targets, so that after data-parallel gradient averaging the
   gradient is that of the mean over every target token of the step, however they are split
   across ranks and micro-batches.
5. Clip, step at the scheduled learning rate; log; eval and checkpoint when due.

Everything random is derived from (seed, step, rank), so a resumed run repeats the steps of an
uninterrupted one exactly.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from opd import checkpoint, preflight
from opd.config import Config, to_dict, to_yaml
from opd.dist import World, all_reduce, barrier, lockstep, shorten_timeout

if TYPE_CHECKING:
    from opd.backends import StudentEngine
    from opd.chat import ChatFormat
    from opd.metrics import MetricsLog
    from opd.rollout import AgentTrajectory
    from opd.teacher import Teacher
    from opd.tools import ToolExecutor


@dataclass
class Run:
    """What a training run holds between steps (built once by `setup`)."""

    config: Config
    world: World
    student: StudentEngine
    teacher: Teacher
    chat: ChatFormat
    executor: ToolExecutor
    parser: Callable
    prompts: list[dict]
    completions: list[dict]
    eval_records: list[dict]
    vocab_size: int
    log: MetricsLog | None = None
    start_step: int = 0
    # dataset name -> epoch -> shuffled record indices (cached; a pure function of seed and epoch)
    epoch_orders: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    # id(completion record) -> its rendered trajectory: rendered once, reused every epoch
    rendered_completions: dict[int, AgentTrajectory] = field(default_factory=dict)


def learning_rate(step: int, config: Config) -> float:
    """Linear warmup to `optim.lr`, then cosine or linear decay to `lr * min_lr_ratio` (1-based)."""
    optim, total = config.optim, config.train.steps
    if step <= optim.warmup_steps:
        return optim.lr * step / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = (step - optim.warmup_steps) / max(1, total - optim.warmup_steps)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
    return optim.lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay)


def step_records(records: list[dict], step: int, config: Config, world: World,
                 orders: dict[int, list[int]]) -> list[dict]:
    """This rank's share of step `step`'s prompts (1-based), in a seeded order, epoch by epoch."""
    per_step = config.train.prompts_per_step
    picked = []
    for position in range((step - 1) * per_step, step * per_step):
        epoch, index = divmod(position, len(records))
        if epoch not in orders:
            order = list(range(len(records)))
            random.Random(f"order/{config.seed}/{epoch}").shuffle(order)
            orders[epoch] = order
        picked.append(records[orders[epoch][index]])
    return picked[world.rank::world.world_size]


def off_policy(config: Config, step: int) -> bool:
    """Whether step `step` trains on dataset completions (same answer on every rank)."""
    if config.loss.gkd_lambda <= 0:
        return False
    return random.Random(f"gkd/{config.seed}/{step}").random() < config.loss.gkd_lambda


def rollout_seed(config: Config, step: int, rank: int) -> int:
    return (config.seed * 1_000_003 + step) * 4099 + rank


def collect(run: Run, step: int) -> tuple[list, bool]:
    """Trajectories of this rank for `step`, and whether they are off-policy completions."""
    from opd.data import DatasetError, completion_trajectory
    from opd.rollout import rollout

    config, world = run.config, run.world
    if off_policy(config, step):
        records = step_records(run.completions, step, config, world,
                               run.epoch_orders.setdefault("completions", {}))
        for r in records:
            if id(r) not in run.rendered_completions:
                run.rendered_completions[id(r)] = completion_trajectory(run.chat, r["messages"],
                                                                        r.get("tools"))
        trajectories = [run.rendered_completions[id(r)] for r in records]
        longest = max((len(t.input_ids) for t in trajectories), default=0)
        if longest > config.train.micro_batch_tokens:
            raise DatasetError(f"data.completions holds a conversation of {longest} tokens, more "
                             f"than train.micro_batch_tokens={config.train.micro_batch_tokens}.")
        return trajectories, True
    prompts = step_records(run.prompts, step, config, world,
                           run.epoch_orders.setdefault("prompts", {}))
    gather = config.student.generation_gather == "once"
    sync = lockstep() if world.distributed and not gather else None
    with run.student.generation_context(gather) as model:
        trajectories = rollout(model, run.chat, run.executor, prompts,
                               config.rollout,
                               seed=rollout_seed(config, step, world.rank), parser=run.parser,
                               sync=sync)
    return trajectories, False


def empty_micro_batch(pad_token_id: int):
    """Two tokens, no targets: a rank with fewer micro-batches runs these to stay in lockstep."""
    from opd.packing import PackedBatch

    return PackedBatch(input_ids=torch.full((1, 2), pad_token_id, dtype=torch.long),
                       position_ids=torch.arange(2)[None],
                       target_mask=torch.zeros((1, 2), dtype=torch.bool),
                       cu_seqlens=torch.tensor([0, 2], dtype=torch.int32), trajectory_index=[])


def head_loss(teacher_hidden_NH, teacher_weight, teacher_bias, target_mask_N, config: Config,
              vocab_size: int, hidden_NH, weight, bias):
    """Sum of the per-token distillation loss over targets, and the target count."""
    from opd.loss import fused_distillation_loss

    loss_sum = fused_distillation_loss(
        hidden_NH, weight, teacher_hidden_NH, teacher_weight, target_mask_N,
        student_bias=bias, teacher_bias=teacher_bias, vocab_size=vocab_size,
        chunk_size=config.loss.chunk_size or None, temperature=config.loss.temperature,
        direction=config.loss.direction, beta=config.loss.beta, reduction="sum")
    return loss_sum, target_mask_N.sum()


def optimize(run: Run, trajectories: list, step: int) -> dict:
    """Teacher-score and learn from this rank's trajectories: one optimizer step (collective)."""
    from opd.packing import pack_varlen

    config, world = run.config, run.world
    batches = pack_varlen(trajectories, config.train.micro_batch_tokens) if trajectories else []
    local_targets = sum(b.num_targets for b in batches)
    most_batches, = all_reduce([len(batches)], op="max")
    global_targets, = all_reduce([local_targets])
    batches += [empty_micro_batch(run.chat.pad_token_id)] * int(most_batches - len(batches))
    scale = world.world_size / max(global_targets, 1.0)

    run.student.train_mode()
    teacher_s = train_s = loss_sum = 0.0
    for batch in batches:
        batch = batch.to(world.device)
        tick = time.perf_counter()
        teacher_hidden = run.teacher.hidden_states(batch.input_ids, batch.position_ids)
        teacher_s += time.perf_counter() - tick
        tick = time.perf_counter()
        with run.teacher.lm_head() as (teacher_weight, teacher_bias):
            loss = partial(head_loss, teacher_hidden, teacher_weight, teacher_bias,
                           batch.target_mask[0], config, run.vocab_size)
            batch_sum, _ = run.student.loss(batch.input_ids, batch.position_ids, loss)
            run.student.backward(batch_sum * scale)
        loss_sum += float(batch_sum.detach())
        train_s += time.perf_counter() - tick
    tick = time.perf_counter()
    lr = learning_rate(step, config)
    grad_norm = run.student.step(lr)
    train_s += time.perf_counter() - tick
    total_loss, = all_reduce([loss_sum])
    loss = total_loss / max(global_targets, 1.0)
    # The loss carries the seed's temperature**2 factor; a KL direction's loss without it is the
    # KL per target token between the temperature-scaled distributions (none for jsd).
    kl = loss / config.loss.temperature ** 2 if config.loss.direction != "jsd" else None
    return {"loss": loss, "kl_per_token": kl, "target_tokens": int(global_targets),
            "micro_batches": int(most_batches), "lr": lr, "grad_norm": grad_norm,
            "teacher_s": round(teacher_s, 4), "train_s": round(train_s, 4)}


def train_step(run: Run, step: int) -> dict:
    started = time.perf_counter()
    trajectories, is_off_policy = collect(run, step)
    rollout_s = time.perf_counter() - started
    learned = optimize(run, trajectories, step)
    valid, invalid, failed, truncated, conversations, tokens = all_reduce(
        [sum(t.counts.valid for t in trajectories), sum(t.counts.invalid for t in trajectories),
         sum(t.counts.failed for t in trajectories), sum(t.truncated for t in trajectories),
         len(trajectories), sum(len(t.input_ids) for t in trajectories)])
    step_s = time.perf_counter() - started
    return {
        "step": step, **learned, "tokens": int(tokens), "conversations": int(conversations),
        "off_policy": is_off_policy, "valid_tool_calls": int(valid),
        "invalid_tool_calls": int(invalid), "failed_tool_calls": int(failed),
        "truncation_rate": truncated / max(conversations, 1.0),
        "rollout_s": round(rollout_s, 4), "step_s": round(step_s, 4),
        "tokens_per_s": learned["target_tokens"] / step_s,
    }


def tool_executor(config: Config):
    from opd.eval import resolve
    from opd.tools import ToolExecutor

    return ToolExecutor(resolve(config.tools.registry, "tools.registry")(),
                        timeout_s=config.tools.timeout_s,
                        max_result_chars=config.tools.max_result_chars,
                        num_workers=config.tools.num_workers,
                        memory_limit_mb=config.tools.memory_limit_mb)


def setup(config: Config, world: World) -> Run:
    """Engines, data and tools of a run; resumes from a checkpoint when configured."""
    from transformers import AutoTokenizer

    from opd.backends import build_student
    from opd.chat import ChatFormat
    from opd.data import load_jsonl
    from opd.metrics import MetricsLog
    from opd.teacher import build_teacher, check_vocabulary
    from opd.tools import get_parser

    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path, local_files_only=True)
    student = build_student(config, world)
    teacher = build_teacher(config, world)
    vocab_size = check_vocabulary(student.hf_model, teacher.hf_model, tokenizer,
                                  config.model.teacher)
    chat = ChatFormat(tokenizer, config.model.chat_template_kwargs,
                      student.hf_model.generation_config)
    run = Run(config=config, world=world, student=student, teacher=teacher, chat=chat,
              executor=tool_executor(config), parser=get_parser(config.tools.parser),
              prompts=load_jsonl(config.data.prompts),
              completions=load_jsonl(config.data.completions) if config.loss.gkd_lambda > 0 else [],
              eval_records=load_jsonl(config.data.eval)[:config.eval.limit or None]
              if config.data.eval and config.eval.every else [],
              vocab_size=vocab_size)
    resume_from = _resume_path(config)
    if resume_from is not None:
        run.start_step = checkpoint.load(resume_from, student, world)["step"]
    run.log = MetricsLog(config.run_dir, enabled=world.is_main, resume_step=run.start_step,
                         wandb_mode=config.logging.wandb_mode,
                         wandb_project=config.logging.wandb_project, run_name=config.name,
                         config=to_dict(config))
    return run


def _resume_path(config: Config) -> Path | None:
    if config.checkpoint.resume == "never":
        return None
    if config.checkpoint.resume == "auto":
        return checkpoint.latest(config.run_dir / "checkpoints")
    path = Path(config.checkpoint.resume)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint.resume: {path} is not a checkpoint directory.")
    return path


def eval_rollout_config(config: Config):
    """Greedy decoding within the recipe's rollout limits."""
    from opd.eval import greedy_rollout_config

    return greedy_rollout_config(**{k: getattr(config.rollout, k) for k in
                                    ("max_turns", "max_new_tokens", "max_total_len", "batch_size")})


def evaluate_student(run: Run) -> dict:
    """Held-out metrics of the current student (rank 0 evaluates the gathered model)."""
    from opd.eval import evaluate, resolve

    config = run.config
    metrics = {}
    with run.student.generation_context(True) as model:
        if run.world.is_main:
            metrics = evaluate(model, run.chat, run.executor, run.eval_records,
                               resolve(config.eval.checker, "eval.checker"),
                               eval_rollout_config(config), seed=config.seed)
        barrier()
    return {f"eval_{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) or v is None}


def train(config: Config, world: World) -> Path | None:
    """Train to `train.steps`, checkpointing and evaluating as configured; export `final/`.

    Returns None when a stop signal (opd.preemption) ended the run early: all ranks agree at a
    step boundary and checkpoint; after USR1 the job is requeued to resume from there.
    """
    from tqdm import tqdm

    from opd import preemption

    run = setup(config, world)
    if world.is_main:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        (config.run_dir / "config.yaml").write_text(to_yaml(config))
    progress = tqdm(total=config.train.steps, initial=run.start_step, desc="OPD", unit="step",
                    disable=not (world.is_main and config.logging.progress))
    try:
        for step in range(run.start_step + 1, config.train.steps + 1):
            record = train_step(run, step)
            if step == run.start_step + 1:  # loaded and compiled: fail fast on a hung rank
                shorten_timeout(config.cluster.collective_timeout_s)
            if config.eval.every and step % config.eval.every == 0 and run.eval_records:
                record.update(evaluate_student(run))
            run.log.log(record)
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
            # A signal during the last step needs no stop: the run finishes and exports.
            stop = preemption.stop_requested() if step < config.train.steps else None
            due = config.checkpoint.every and step % config.checkpoint.every == 0
            if stop or due or step == config.train.steps:
                checkpoint.save(config.run_dir / "checkpoints", step, run.student,
                                {"name": config.name}, world, config.checkpoint.keep)
            if stop:
                preemption.after_checkpoint(stop)
                return None
        final = config.run_dir / "final"
        run.student.export_hf(final)
        if world.is_main:
            run.chat.tokenizer.save_pretrained(final)
        barrier()
        return final
    finally:
        progress.close()
        run.log.close()
        run.executor.close()


def prepare(config: Config, world: World) -> Config:
    """Run the recipe's prepare step (one builder per node, others reuse its cache)."""
    if not config.prepare:
        return config
    from opd.config import with_prepared
    from opd.eval import resolve

    build = resolve(config.prepare, "prepare")
    if world.local_rank == 0:
        prepared = build()
    barrier()
    if world.local_rank != 0:
        prepared = build()
    return with_prepared(config, getattr(prepared, "root", prepared))


def evaluate_model(config: Config, model_path: str | Path, label: str, device) -> dict:
    """Held-out metrics of a saved Hugging Face model: greedy, the rollout's limits, the run's
    tokenizer and chat template."""
    from transformers import AutoTokenizer

    from opd.chat import ChatFormat
    from opd.data import load_jsonl
    from opd.eval import evaluate, load_model, resolve

    model = load_model(model_path, device, label)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path, local_files_only=True)
    chat = ChatFormat(tokenizer, config.model.chat_template_kwargs, model.generation_config)
    with tool_executor(config) as executor:
        metrics = evaluate(model, chat, executor,
                           load_jsonl(config.data.eval)[:config.eval.limit or None],
                           resolve(config.eval.checker, "eval.checker"),
                           eval_rollout_config(config), seed=config.seed,
                           progress=f"eval {label}" if config.logging.progress else None)
    metrics.pop("samples", None)
    return metrics


TABLE_COLUMNS = ("success_rate", "answer_accuracy", "tool_call_validity", "truncation_rate",
                 "mean_turns")


def results_table(rows: dict[str, dict]) -> str:
    """A fixed-width table: one row per evaluated model."""
    def cell(value) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["model    " + "  ".join(f"{c:>18}" for c in TABLE_COLUMNS)]
    for label, metrics in rows.items():
        cells = (f"{cell(metrics.get(c)):>18}" for c in TABLE_COLUMNS)
        lines.append(f"{label:<9}" + "  ".join(cells))
    return "\n".join(lines)


def run_recipe(config: Config, world: World) -> dict[str, dict]:
    """prepare -> eval teacher and student -> OPD -> eval the trained student -> table."""
    config = prepare(config, world)
    config = preflight.check(config, world)  # before any engine: run dir, writability, wandb
    evaluating = bool(config.data.eval) and world.is_main
    rows: dict[str, dict] = {}
    if evaluating and config.eval.before:
        if config.eval.teacher:
            rows["teacher"] = evaluate_model(config, config.model.teacher, "model.teacher",
                                             world.device)
        rows["before"] = evaluate_model(config, config.model.student, "model.student",
                                        world.device)
    barrier()
    final = train(config, world)
    if final is None:  # stopped early to be requeued; the resumed run evaluates
        return rows
    if evaluating and config.eval.after:
        rows["after"] = evaluate_model(config, final, "trained student", world.device)
    if world.is_main and rows:
        import json

        (config.run_dir / "eval.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(results_table(rows), flush=True)
    barrier()
    return rows
