"""The OPD loop. One optimizer step, in five stages:

1. collect   this rank's prompts of the step (opd.steps) are sampled by the run's sampler
             (opd.sampling: an engine from a registry), tools run in the sandbox (opd.tools);
             or, on an off-policy step, the same share of dataset completions
             (loss.off_policy_fraction); a teacher that scores whole conversations scores them
             here (opd.teachers);
2. pack      varlen micro-batches; ranks agree on the micro-batch count (short ranks add empty
             ones) and on the step's global number of target tokens;
3. teacher   per micro-batch, the teacher's signal (opd.teachers.base: full distribution, top-k
             or sampled tokens; no grad); none for loss.direction=sft, whose teacher is one-hot
             on the completion's tokens;
4. loss      the student's fused loss (opd.objective), summed over target tokens and scaled by
             world_size / global_targets: after data-parallel gradient averaging the gradient is
             that of the mean over every target token of the step, however they are split;
5. step      clip and step at the scheduled learning rate, unless the loss or the gradient norm
             is not finite or the step has no target tokens (then nothing is applied:
             train.nonfinite); log; eval and checkpoint when due.

Everything random is derived from (seed, step, rank), so a resumed run repeats the steps of an
uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from opd import checkpoint, divergences, preemption
from opd.backends import StudentEngine, build_student
from opd.config import Config, to_dict, to_yaml
from opd.dist import World, all_reduce, barrier, shorten_timeout
from opd.errors import MissingFileError, NonFiniteError, OPDError
from opd.eval import episode_reward, evaluate, greedy, tool_executor
from opd.inputs import RunInputs
from opd.loss_sampled import STAT_REDUCTIONS, accumulate_stats, summarize_stats
from opd.metrics import MetricsLog
from opd.objective import DistillationHead
from opd.packing import PackedBatch, empty_micro_batch, pack_varlen, per_target
from opd.plugins import Plugins
from opd.rewards import group_advantages, token_advantages
from opd.sampling.base import OnFinished, Sampler, SamplerContext, sampler_class
from opd.steps import learning_rate, off_policy, rollout_seed, step_records
from opd.teachers.base import (
    SignalRequest,
    Teacher,
    TeacherSignal,
    open_head,
    packed_signal,
    teacher_class,
)
from opd.teachers.overlap import ScoringQueue
from opd.tools import ToolExecutor
from opd.trajectory import AgentTrajectory


@dataclass
class Run:
    """What a training run holds between steps."""

    config: Config
    plugins: Plugins
    inputs: RunInputs
    world: World
    student: StudentEngine
    teacher: Teacher | None  # None: SFT (a one-hot teacher) or pure RL (loss.distill_weight=0)
    signal: SignalRequest  # what the loss asks of the teacher
    sampler: Sampler
    executor: ToolExecutor
    log: MetricsLog
    start_step: int = 0
    nonfinite_in_a_row: int = 0
    nonfinite_steps: int = 0
    # dataset name -> epoch -> shuffled record indices (a pure function of seed and epoch)
    epoch_orders: dict[str, dict[int, list[int]]] = field(default_factory=dict)


def train(config: Config, plugins: Plugins, inputs: RunInputs, world: World) -> Path | None:
    """Train to `train.steps`, checkpointing and evaluating as configured; export `final/`.

    Returns None when a stop signal (opd.preemption) ended the run early: all ranks agree at a
    step boundary and checkpoint; after USR1 the job is requeued to resume from there.
    """
    run = start(config, plugins, inputs, world)
    progress = tqdm(total=config.train.steps, initial=run.start_step, desc="OPD", unit="step",
                    disable=not (world.is_main and config.logging.progress))
    try:
        for step in range(run.start_step + 1, config.train.steps + 1):
            record = train_step(run, step)
            if step == run.start_step + 1:  # loaded and compiled: fail fast on a hung rank
                shorten_timeout(config.cluster.collective_timeout_s)
            if config.eval.every and step % config.eval.every == 0 and inputs.eval_records:
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
            inputs.chat.tokenizer.save_pretrained(final)
        barrier()
        return final
    finally:
        progress.close()
        run.log.close()
        run.executor.close()
        run.sampler.close()
        if run.teacher is not None:
            run.teacher.close()


def start(config: Config, plugins: Plugins, inputs: RunInputs, world: World) -> Run:
    """Engines and tools of a run, resumed from a checkpoint when one is configured."""
    torch.manual_seed(config.seed)
    if world.is_main:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        (config.run_dir / "config.yaml").write_text(to_yaml(config))
    student = build_student(config.model.student, config.student, config.optim, world)
    teacher = teacher_class(config.teacher.engine).build(config, world) \
        if config.loss.needs_teacher else None
    executor = tool_executor(plugins.tool_registry, config.tools, plugins.environment)
    resume_from = resume_path(config)
    start_step = checkpoint.load(resume_from, student, world)["step"] if resume_from else 0
    log = MetricsLog(config.run_dir, enabled=world.is_main, resume_step=start_step,
                     wandb_mode=config.logging.wandb_mode,
                     wandb_project=config.logging.wandb_project, run_name=config.name,
                     config=to_dict(config))
    sampler = sampler_class(config.rollout.engine)(SamplerContext(
        config, world, student, inputs.chat, executor, plugins.parser, inputs.vocab_size))
    return Run(config=config, plugins=plugins, inputs=inputs, world=world, student=student,
               teacher=teacher, signal=signal_request(config, inputs.vocab_size),
               sampler=sampler, executor=executor, log=log, start_step=start_step)


def signal_request(config: Config, vocab_size: int) -> SignalRequest:
    """What the loss asks of the teacher: `teacher.signal`, or the direction's own need."""
    kind = config.teacher_signal
    # A k past the vocabulary is the whole distribution as top-k (no tail).
    return SignalRequest(kind, vocab_size, config.loss.temperature,
                         min(config.teacher.top_k, vocab_size))


def resume_path(config: Config) -> Path | None:
    if config.checkpoint.resume == "never":
        return None
    if config.checkpoint.resume == "auto":
        return checkpoint.latest(config.run_dir / "checkpoints")
    path = Path(config.checkpoint.resume)
    if not path.is_dir():
        raise MissingFileError(f"checkpoint.resume: {path} is not a checkpoint directory.")
    return path


def train_step(run: Run, step: int) -> dict:
    started = time.perf_counter()
    trajectories, is_off_policy, collect_metrics = collect(run, step)
    rollout_s = time.perf_counter() - started - collect_metrics.get("teacher_collect_s", 0.0)
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
        "tokens_per_s": learned["target_tokens"] / step_s, **collect_metrics,
    }


def collect(run: Run, step: int) -> tuple[list[AgentTrajectory], bool, dict]:
    """Stage 1: this rank's trajectories for `step`, whether they are off-policy, and the
    sampler's metrics; a per-conversation teacher scores them here, a served one each as soon
    as the rollout finishes it (teacher.overlap), and then only the last answers are waited on
    (`teacher_collect_s`)."""
    config, world = run.config, run.world
    metrics: dict = {}
    is_off_policy = off_policy(config, step)
    teacher = run.teacher
    early = ScoringQueue(teacher, run.signal) if teacher is not None and \
        teacher.overlaps_rollout and config.teacher.overlap and not is_off_policy else None
    try:
        if is_off_policy:
            trajectories = step_records(run.inputs.completions, step, config, world.rank,
                                        world.world_size,
                                        run.epoch_orders.setdefault("completions", {}))
        else:
            prompts = step_records(run.inputs.prompts, step, config, world.rank,
                                   world.world_size, run.epoch_orders.setdefault("prompts", {}))
            group = config.rollout.samples_per_prompt  # a prompt's samples stay on one rank
            prompts = [record for record in prompts for _ in range(group)]
            cut = config.loss.mask_after_refusals
            finished = early if early is None or not cut else _masking_refusals(early, cut)
            trajectories = run.sampler.sample(prompts, rollout_seed(config, step, world.rank),
                                              finished)
            for trajectory in trajectories:
                trajectory.mask_after_refusals(cut)
            metrics.update(run.sampler.metrics())
            if config.loss.reward_weight > 0:
                metrics.update(score_rewards(run, prompts, trajectories))
        if teacher is not None and teacher.per_conversation:
            tick = time.perf_counter()
            # Copies: dataset completions are reused by later steps and must not keep scores.
            trajectories = [dataclasses.replace(t) for t in trajectories]
            failure: OPDError | None = None
            try:
                if early is not None:
                    early.wait(trajectories)
                else:
                    teacher.score_conversations(trajectories, run.signal)
            except OPDError as error:  # e.g. a served teacher that died: every rank stops
                failure = error
            if all_reduce([failure is not None], op="max")[0]:
                raise failure or OPDError(f"step {step}: another rank's teacher scoring failed "
                                          "(its error names the teacher); nothing was trained.")
            metrics["teacher_collect_s"] = round(time.perf_counter() - tick, 4)
    finally:
        if early is not None:  # a failed rollout or step sends nothing more
            early.cancel()
    return trajectories, is_off_policy, metrics


def _masking_refusals(on_finished: OnFinished, count: int) -> OnFinished:
    """`on_finished` hearing of each conversation with its targets after `count` refusals
    masked, so an early-scoring teacher scores only the tokens that train."""
    def masked(index: int, trajectory: AgentTrajectory) -> None:
        trajectory.mask_after_refusals(count)
        on_finished(index, trajectory)
    return masked


def score_rewards(run: Run, prompts: list[dict], trajectories: list[AgentTrajectory]) -> dict:
    """Each episode's reward by the world's checker, and its advantage within its prompt's
    group of rollout.samples_per_prompt episodes; the step's reward statistics."""
    config, tokenizer = run.config, run.inputs.chat.tokenizer
    rewards = [episode_reward(record, trajectory, tokenizer, run.plugins.eval_checker)
               for record, trajectory in zip(prompts, trajectories)]
    groups = [index // config.rollout.samples_per_prompt for index in range(len(rewards))]
    advantages = group_advantages(rewards, groups, config.loss.advantage_norm)
    for trajectory, reward, advantage in zip(trajectories, rewards, advantages):
        trajectory.reward, trajectory.advantage = reward, advantage
    total, square, count = all_reduce([sum(rewards), sum(r * r for r in rewards), len(rewards)])
    mean = total / max(count, 1.0)
    return {"reward_mean": mean, "reward_std": max(square / max(count, 1.0) - mean ** 2, 0.0) ** 0.5}


def teacher_signal(run: Run, batch: PackedBatch,
                   trajectories: list[AgentTrajectory]) -> TeacherSignal | None:
    """Stage 3: the teacher's signal for one micro-batch (collective for sharded teachers);
    None for pure RL."""
    if run.teacher is None:  # SFT reads the labels; pure RL no teacher
        return None
    if run.teacher.per_conversation:
        return packed_signal(batch, trajectories, run.signal, run.teacher.head)
    return run.teacher.score_micro_batch(batch, run.signal)


def sampled_inputs(run: Run, batch: PackedBatch, trajectories: list[AgentTrajectory]) -> dict:
    """What the sampled-token estimator reads besides the teacher: the labels, the sampler's
    log-prob of each (as it recorded them) and the episodes' reward advantages."""
    packed = [trajectories[index] for index in batch.trajectory_index]
    inputs = {"labels_N": batch.input_ids[0].roll(-1), "sampler_logprobs_N": per_target(
        batch, [torch.tensor(t.logprobs, dtype=torch.float32) for t in packed])}
    if run.config.loss.reward_weight > 0:
        inputs["advantages_N"] = token_advantages(
            [t.advantage for t in trajectories], batch.cu_seqlens, batch.trajectory_index,
            batch.target_mask[0])
    return inputs


def optimize(run: Run, trajectories: list[AgentTrajectory], step: int) -> dict:
    """Stages 2-5 on this rank's trajectories: one optimizer step (collective)."""
    config, world = run.config, run.world
    batches, global_targets = pack(run, trajectories)
    scale = world.world_size / max(global_targets, 1.0)

    run.student.train_mode()
    teacher_s = train_s = loss_sum = 0.0
    teacher_tokens = 0
    reads = divergences.get(config.loss.direction).signal
    sampled = reads == "sampled"
    stats: dict[str, torch.Tensor] | None = None
    forward_kl_tokens = 0.0  # hybrid_kl's target tokens on forward KL
    for batch in batches:
        batch = batch.to(world.device)
        extra = sampled_inputs(run, batch, trajectories) if sampled \
            else {"labels_N": batch.input_ids[0].roll(-1)} if reads == "labels" else {}
        tick = time.perf_counter()
        signal = teacher_signal(run, batch, trajectories)
        if run.teacher is not None:
            teacher_s += time.perf_counter() - tick
            teacher_tokens += batch.num_tokens
            tick = time.perf_counter()
        with open_head(signal) as teacher_head:
            head = DistillationHead(signal, teacher_head, batch.target_mask[0], config.loss,
                                    run.inputs.vocab_size, **extra)
            batch_sum, _ = run.student.loss(batch.input_ids, batch.position_ids, head.loss)
            run.student.backward(batch_sum * scale)
        if sampled:
            stats = accumulate_stats(stats, head.stats)
        forward_kl_tokens += float(head.stats.get("forward_kl_tokens", 0.0))
        loss_sum += float(batch_sum.detach())
        train_s += time.perf_counter() - tick
    total_loss, global_teacher_tokens, global_forward_kl_tokens = all_reduce(
        [loss_sum, teacher_tokens, forward_kl_tokens])
    loss = total_loss / max(global_targets, 1.0)

    tick = time.perf_counter()
    lr = learning_rate(step, config.optim, config.train.steps)
    # A step without target tokens (every conversation ended before the student wrote one: an
    # environment that never starts, prompts that fill the budget) has nothing to learn from.
    empty = not global_targets
    grad_norm, applied = run.student.step(lr, skip=empty or not math.isfinite(loss))
    applied = applied and not empty  # an engine may run an empty step at lr 0: nothing changes
    train_s += time.perf_counter() - tick
    if applied:
        run.sampler.weights_changed()
    guard_nonfinite(run, step, loss, grad_norm, applied,
                    why_empty(trajectories) if empty else None)
    # The loss carries the seed's temperature**2 factor; a KL direction's loss without it is the
    # KL per target token between the temperature-scaled distributions (none for jsd and sft).
    kl = loss / config.loss.temperature ** 2 \
        if divergences.get(config.loss.direction).kl_reported else None
    estimator = sampled_statistics(stats) if sampled else {}
    if config.loss.direction == "hybrid_kl":  # how much of the step took forward KL's pull
        estimator["forward_kl_fraction"] = global_forward_kl_tokens / max(global_targets, 1.0)
    if sampled and run.teacher is not None:  # the k1 estimate of KL(student || teacher)
        kl = estimator["kl_k1"]
    return {**estimator, "loss": loss, "kl_per_token": kl, "target_tokens": int(global_targets),
            "teacher_tokens": int(global_teacher_tokens),
            "micro_batches": len(batches), "lr": lr, "grad_norm": grad_norm,
            "skipped": not applied, "nonfinite_steps": run.nonfinite_steps,
            "teacher_s": round(teacher_s, 4), "train_s": round(train_s, 4)}


def sampled_statistics(stats: dict[str, torch.Tensor] | None) -> dict:
    """The sampled-token estimator's figures of the step, over every rank's target tokens
    (KL estimates, importance weights, truncated and clipped fractions, advantages, the
    sampler-learner log-prob gap)."""
    names = list(STAT_REDUCTIONS)
    local = [float(stats[name]) if stats is not None else 0.0 for name in names]
    summed = all_reduce([v for v, n in zip(local, names) if STAT_REDUCTIONS[n] == "sum"])
    maxed = all_reduce([v for v, n in zip(local, names) if STAT_REDUCTIONS[n] == "max"], op="max")
    combined = dict(zip([n for n in names if STAT_REDUCTIONS[n] == "sum"], summed))
    combined.update(zip([n for n in names if STAT_REDUCTIONS[n] == "max"], maxed))
    return summarize_stats(combined)


def pack(run: Run, trajectories: list[AgentTrajectory]) -> tuple[list[PackedBatch], float]:
    """Stage 2: micro-batches, padded to the count of the rank with most, and the step's
    global number of target tokens."""
    batches = pack_varlen(trajectories, run.config.train.micro_batch_tokens) \
        if trajectories else []
    most_batches, = all_reduce([len(batches)], op="max")
    global_targets, = all_reduce([sum(b.num_targets for b in batches)])
    empty = empty_micro_batch(run.inputs.chat.pad_token_id)
    return batches + [empty] * int(most_batches - len(batches)), global_targets


def guard_nonfinite(run: Run, step: int, loss: float, grad_norm: float, applied: bool,
                    empty: str | None = None) -> None:
    """Count a step the engine did not apply; stop as `train.nonfinite` says.

    `empty`: why the step had no target tokens (None when it had some); such a step is skipped
    and counted like a non-finite one, so a run that never trains fails instead of exporting
    the untouched student. Every rank sees the same all-reduced loss, target count and global
    norm, so all ranks decide alike. A non-finite loss with an applied update cannot be undone:
    the run stops before the next checkpoint could keep it.
    """
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if applied and finite:
        run.nonfinite_in_a_row = 0
        return
    run.nonfinite_steps += 1
    run.nonfinite_in_a_row += 1
    train = run.config.train
    what = f"step {step}: no target tokens ({empty})" if empty is not None else \
        f"step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}"
    if applied:
        raise NonFiniteError(f"{what} was applied by the optimizer although not finite; the run "
                             "stops before a checkpoint could keep it.")
    if step == train.steps and run.nonfinite_steps == step - run.start_step:
        raise NonFiniteError(f"{what}: no step of this run was finite with target tokens, so "
                             "nothing was learned and nothing is exported. Check the teacher's "
                             "weights, the learning rate, the data and the environment.")
    if train.nonfinite == "stop" or run.nonfinite_in_a_row >= train.max_nonfinite_steps:
        raise NonFiniteError(
            f"{what}: {run.nonfinite_in_a_row} step(s) in a row not finite or without target "
            f"tokens, skipped (train.nonfinite={train.nonfinite}, train.max_nonfinite_steps="
            f"{train.max_nonfinite_steps}); checkpoints hold only applied steps. Check the "
            "teacher's weights, the learning rate, the data and the environment.")
    if run.world.is_main:
        tqdm.write(f"warning: {what}{'' if empty else ' not finite'}; step skipped, nothing applied "
                   f"({run.nonfinite_in_a_row} in a row).")


def why_empty(trajectories: list[AgentTrajectory]) -> str:
    """Why this rank's conversations of a step hold no student token, in a few words."""
    reasons = {t.environment_error or t.truncation_reason for t in trajectories} - {None}
    if not trajectories or not reasons:
        return "no conversation holds a token the student wrote"
    return "every conversation ended before the student wrote a token: " + \
        "; ".join(sorted(str(r) for r in reasons))[:300]


def evaluate_student(run: Run) -> dict:
    """Held-out metrics of the current student (rank 0 evaluates the gathered model)."""
    config = run.config
    metrics = {}
    with run.student.generation_context(True) as model:
        if run.world.is_main:
            metrics = evaluate(model, run.inputs.chat, run.executor, run.inputs.eval_records,
                               run.plugins.eval_checker, greedy(config.rollout), seed=config.seed,
                               parser=run.plugins.parser)
        barrier()
    return {f"eval_{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) or v is None}
