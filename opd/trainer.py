"""The OPD loop. One optimizer step, in five stages:

1. rollout   this rank's prompts of the step (opd.steps) are sampled by the student under its
             generation context, tools run in the sandbox (opd.tools); or, on an off-policy
             step, the same share of dataset completions (loss.off_policy_fraction);
2. pack      varlen micro-batches; ranks agree on the micro-batch count (short ranks add empty
             ones) and on the step's global number of target tokens;
3. teacher   per micro-batch, the teacher's final hidden states (no grad; none for
             loss.direction=sft, whose loss is the cross-entropy of the completion's tokens);
4. loss      the student's fused distillation loss, summed over target tokens and scaled by
             world_size / global_targets: after data-parallel gradient averaging the gradient is
             that of the mean over every target token of the step, however they are split;
5. step      clip and step at the scheduled learning rate, unless the loss or the gradient norm
             is not finite or the step has no target tokens (then nothing is applied:
             train.nonfinite); log; eval and checkpoint when due.

Everything random is derived from (seed, step, rank), so a resumed run repeats the steps of an
uninterrupted one exactly.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from opd import checkpoint, preemption
from opd.backends import StudentEngine, build_student
from opd.config import Config, to_dict, to_yaml
from opd.dist import World, all_reduce, barrier, consecutive_group, lockstep, shorten_timeout
from opd.errors import MissingFileError, NonFiniteError
from opd.eval import evaluate, greedy, tool_executor
from opd.inputs import RunInputs
from opd.loss import fused_cross_entropy_loss, fused_distillation_loss
from opd.metrics import MetricsLog
from opd.packing import PackedBatch, pack_varlen
from opd.plugins import Plugins
from opd.rollout import AgentTrajectory, rollout
from opd.steps import learning_rate, off_policy, rollout_seed, step_records
from opd.teacher import Teacher, build_teacher
from opd.tools import ToolExecutor
from opd.vllm_engine import MirroredEngine, VLLMEngine, check_servable


@dataclass
class Run:
    """What a training run holds between steps."""

    config: Config
    plugins: Plugins
    inputs: RunInputs
    world: World
    student: StudentEngine
    teacher: Teacher
    executor: ToolExecutor
    log: MetricsLog
    start_step: int = 0
    sampler: VLLMEngine | None = None  # rollout.engine=vllm: this rank's engine (or shard)
    sampler_group: MirroredEngine | None = None  # rollout.vllm_tensor_parallel_size > 1
    sampler_stale: bool = True  # the student stepped since its weights went to the sampler
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


def start(config: Config, plugins: Plugins, inputs: RunInputs, world: World) -> Run:
    """Engines and tools of a run, resumed from a checkpoint when one is configured."""
    torch.manual_seed(config.seed)
    if world.is_main:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        (config.run_dir / "config.yaml").write_text(to_yaml(config))
    if config.rollout.engine == "vllm":
        check_servable(config.model.student, world, config.rollout.vllm_tensor_parallel_size)
    student = build_student(config.model.student, config.student, config.optim, world)
    teacher = build_teacher(config.model.teacher, config.teacher, world)
    executor = tool_executor(plugins.tool_registry, config.tools, plugins.environment)
    resume_from = resume_path(config)
    start_step = checkpoint.load(resume_from, student, world)["step"] if resume_from else 0
    log = MetricsLog(config.run_dir, enabled=world.is_main, resume_step=start_step,
                     wandb_mode=config.logging.wandb_mode,
                     wandb_project=config.logging.wandb_project, run_name=config.name,
                     config=to_dict(config))
    sampler, sampler_group = None, None
    if config.rollout.engine == "vllm":
        tp_size = config.rollout.vllm_tensor_parallel_size
        leader = world.rank - world.rank % tp_size
        sampler = VLLMEngine(config.model.student, max_model_len=config.rollout.max_total_len,
                             dtype=student.dtype, seed=config.seed + leader,
                             gpu_memory_utilization=config.rollout.gpu_memory_utilization,
                             tensor_parallel_size=tp_size,
                             enable_sleep_mode=world.device.type == "cuda")
        if tp_size > 1:  # control messages only: gloo, on any device
            sampler_group = MirroredEngine(sampler, consecutive_group(world, tp_size, "gloo"),
                                           leader, world.rank == leader)
        if world.device.type == "cuda":
            sampler.sleep()  # until the first rollout: training needs the memory first
    return Run(config=config, plugins=plugins, inputs=inputs, world=world, student=student,
               teacher=teacher, executor=executor, log=log, start_step=start_step,
               sampler=sampler, sampler_group=sampler_group)


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
    trajectories, is_off_policy, sampler_metrics = collect(run, step)
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
        "tokens_per_s": learned["target_tokens"] / step_s, **sampler_metrics,
    }


def collect(run: Run, step: int) -> tuple[list[AgentTrajectory], bool, dict]:
    """Stage 1: this rank's trajectories for `step`, whether they are off-policy, and the
    vLLM sampler's metrics (weight sync seconds, log-prob gap) when it sampled them."""
    config, world = run.config, run.world
    if off_policy(config, step):
        return step_records(run.inputs.completions, step, config, world.rank, world.world_size,
                            run.epoch_orders.setdefault("completions", {})), True, {}
    prompts = step_records(run.inputs.prompts, step, config, world.rank, world.world_size,
                           run.epoch_orders.setdefault("prompts", {}))
    seed = rollout_seed(config, step, world.rank)
    if run.sampler is not None:
        # On GPU vLLM sleeps while the student trains: its KV cache and weights leave the device.
        sleeps = world.device.type == "cuda"
        if sleeps:
            run.sampler.wake_up()
        sync_s = sync_sampler(run, run.sampler)
        trajectories = sample_with_vllm(run, prompts, seed)
        if sleeps:
            run.sampler.sleep()
        return trajectories, False, {"sync_s": round(sync_s, 4),
                                     **sampler_logprob_gap(run, trajectories)}
    gather = config.student.generation_gather == "once"
    sync = lockstep() if world.distributed and not gather else None
    with run.student.generation_context(gather) as model:
        trajectories = rollout(model, run.inputs.chat, run.executor, prompts, config.rollout,
                               seed=seed, parser=run.plugins.parser, sync=sync,
                               vocab_size=run.inputs.vocab_size)
    return trajectories, False, {}


def sample_with_vllm(run: Run, prompts: list[dict], seed: int) -> list[AgentTrajectory]:
    """This rank's trajectories from the vLLM engine: its own engine's, or, for a group of ranks
    sharing one tensor-parallel engine, its share of what the group's first rank sampled for all
    the group's prompts (with that rank's seed) while the others mirrored its engine calls."""
    def sample(records: list[dict], engine) -> list[AgentTrajectory]:
        return rollout(None, run.inputs.chat, run.executor, records, run.config.rollout,
                       seed=seed, parser=run.plugins.parser, vocab_size=run.inputs.vocab_size,
                       engine=engine)

    group = run.sampler_group
    if group is None:
        return sample(prompts, run.sampler)
    import torch.distributed as dist

    shares: list | None = [None] * dist.get_world_size(group.group) if group.is_leader else None
    dist.gather_object(prompts, shares, dst=group.leader, group=group.group)
    if group.is_leader:
        assert shares is not None
        try:
            trajectories = sample([record for share in shares for record in share], group)
        finally:
            group.finish()
        starts = [0, *itertools.accumulate(len(share) for share in shares)]
        shares = [trajectories[a:b] for a, b in zip(starts, starts[1:])]
    else:
        group.follow()
    mine: list = [None]
    dist.scatter_object_list(mine, shares, src=group.leader, group=group.group)
    return mine[0]


def sync_sampler(run: Run, sampler: VLLMEngine) -> float:
    """Stream the student's weights into vLLM if a step changed them; the seconds it took."""
    if not run.sampler_stale:
        return 0.0
    started = time.perf_counter()
    sampler.load_weights(run.student.full_parameters())
    run.sampler_stale = False
    return time.perf_counter() - started


@torch.no_grad()
def sampler_logprob_gap(run: Run, trajectories: list[AgentTrajectory]) -> dict:
    """Mean and max |log-prob under vLLM - log-prob under the student's own forward| over the
    sampled tokens of this rank: near zero when the weight sync is right (what TRL and verl
    log). Costs one extra forward of the student per conversation, with the student gathered
    as generation_gather=once does (ranks hold different numbers of conversations)."""
    gaps = []
    temperature = run.config.rollout.temperature
    vocab = run.inputs.vocab_size
    with run.student.generation_context(True) as model:
        for trajectory in trajectories:
            targets = [i for i, target in enumerate(trajectory.assistant_mask) if target]
            if not targets:
                continue
            ids_1T = torch.tensor([trajectory.input_ids], device=run.world.device)
            logits_TV = model(input_ids=ids_1T, use_cache=False).logits[0, :, :vocab]
            logprobs_TV = torch.log_softmax(logits_TV.float() / temperature, dim=-1)
            positions = torch.tensor(targets, device=ids_1T.device)
            trained = logprobs_TV[positions - 1, ids_1T[0, positions]]
            sampled = torch.tensor(trajectory.logprobs, device=trained.device)
            gaps.append((trained - sampled).abs())
    gap = torch.cat(gaps) if gaps else torch.zeros(1)
    total, count = all_reduce([float(gap.sum()), float(gap.numel())])
    return {"sampler_logprob_gap_mean": total / max(count, 1.0),
            "sampler_logprob_gap_max": all_reduce([float(gap.max())], op="max")[0]}


@dataclass
class DistillationHead:
    """The student's loss on one micro-batch, given the teacher's side of it: called by the
    student engine inside its forward with its final hidden states and lm_head."""

    teacher_hidden_NH: torch.Tensor
    teacher_weight_VH: torch.Tensor
    teacher_bias_V: torch.Tensor | None
    target_mask_N: torch.Tensor
    config: Config
    vocab_size: int

    def __call__(self, hidden_NH, weight_VH, bias_V) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of the per-token loss over targets, and the target count."""
        loss = self.config.loss
        loss_sum = fused_distillation_loss(
            hidden_NH, weight_VH, self.teacher_hidden_NH, self.teacher_weight_VH,
            self.target_mask_N, student_bias=bias_V, teacher_bias=self.teacher_bias_V,
            vocab_size=self.vocab_size, chunk_size=loss.chunk_size or None,
            temperature=loss.temperature, direction=loss.direction, beta=loss.beta,
            reduction="sum")
        return loss_sum, self.target_mask_N.sum()


@dataclass
class CrossEntropyHead:
    """The student's SFT loss on one micro-batch (loss.direction=sft): no teacher."""

    labels_N: torch.Tensor  # the token each position predicts: input_ids shifted left by one
    target_mask_N: torch.Tensor
    config: Config
    vocab_size: int

    def __call__(self, hidden_NH, weight_VH, bias_V) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of the per-token cross-entropy over targets, and the target count."""
        loss = self.config.loss
        loss_sum = fused_cross_entropy_loss(
            hidden_NH, weight_VH, self.labels_N, self.target_mask_N, student_bias=bias_V,
            vocab_size=self.vocab_size, chunk_size=loss.chunk_size or None,
            temperature=loss.temperature, reduction="sum")
        return loss_sum, self.target_mask_N.sum()


def optimize(run: Run, trajectories: list[AgentTrajectory], step: int) -> dict:
    """Stages 2-5 on this rank's trajectories: one optimizer step (collective)."""
    config, world = run.config, run.world
    batches, global_targets = pack(run, trajectories)
    scale = world.world_size / max(global_targets, 1.0)

    run.student.train_mode()
    teacher_s = train_s = loss_sum = 0.0
    teacher_tokens = 0
    for batch in batches:
        batch = batch.to(world.device)
        tick = time.perf_counter()
        if config.loss.direction == "sft":
            # Position i predicts token i + 1; the last label is never a target.
            sft_head = CrossEntropyHead(batch.input_ids[0].roll(-1), batch.target_mask[0],
                                        config, run.inputs.vocab_size)
            batch_sum, _ = run.student.loss(batch.input_ids, batch.position_ids, sft_head)
            run.student.backward(batch_sum * scale)
        else:
            teacher_hidden = run.teacher.hidden_states(batch.input_ids, batch.position_ids)
            teacher_s += time.perf_counter() - tick
            teacher_tokens += batch.num_tokens
            tick = time.perf_counter()
            with run.teacher.lm_head() as (teacher_weight, teacher_bias):
                head = DistillationHead(teacher_hidden, teacher_weight, teacher_bias,
                                        batch.target_mask[0], config, run.inputs.vocab_size)
                batch_sum, _ = run.student.loss(batch.input_ids, batch.position_ids, head)
                run.student.backward(batch_sum * scale)
        loss_sum += float(batch_sum.detach())
        train_s += time.perf_counter() - tick
    total_loss, global_teacher_tokens = all_reduce([loss_sum, teacher_tokens])
    loss = total_loss / max(global_targets, 1.0)

    tick = time.perf_counter()
    lr = learning_rate(step, config.optim, config.train.steps)
    # A step without target tokens (every conversation ended before the student wrote one: an
    # environment that never starts, prompts that fill the budget) has nothing to learn from.
    empty = not global_targets
    grad_norm, applied = run.student.step(lr, skip=empty or not math.isfinite(loss))
    applied = applied and not empty  # DeepSpeed steps an empty step at lr 0: nothing changes
    train_s += time.perf_counter() - tick
    run.sampler_stale = run.sampler_stale or applied
    guard_nonfinite(run, step, loss, grad_norm, applied, why_empty(trajectories) if empty else None)
    # The loss carries the seed's temperature**2 factor; a KL direction's loss without it is the
    # KL per target token between the temperature-scaled distributions (none for jsd and sft).
    kl = loss / config.loss.temperature ** 2 \
        if config.loss.direction in ("forward_kl", "reverse_kl") else None
    return {"loss": loss, "kl_per_token": kl, "target_tokens": int(global_targets),
            "teacher_tokens": int(global_teacher_tokens),
            "micro_batches": len(batches), "lr": lr, "grad_norm": grad_norm,
            "skipped": not applied, "nonfinite_steps": run.nonfinite_steps,
            "teacher_s": round(teacher_s, 4), "train_s": round(train_s, 4)}


def pack(run: Run, trajectories: list[AgentTrajectory]) -> tuple[list[PackedBatch], float]:
    """Stage 2: micro-batches, padded to the count of the rank with most, and the step's
    global number of target tokens."""
    batches = pack_varlen(trajectories, run.config.train.micro_batch_tokens) \
        if trajectories else []
    most_batches, = all_reduce([len(batches)], op="max")
    global_targets, = all_reduce([sum(b.num_targets for b in batches)])
    empty = empty_micro_batch(run.inputs.chat.pad_token_id)
    return batches + [empty] * int(most_batches - len(batches)), global_targets


def empty_micro_batch(pad_token_id: int) -> PackedBatch:
    """Two tokens, no targets: a rank with fewer micro-batches runs these to stay in lockstep."""
    return PackedBatch(input_ids=torch.full((1, 2), pad_token_id, dtype=torch.long),
                       position_ids=torch.arange(2)[None],
                       target_mask=torch.zeros((1, 2), dtype=torch.bool),
                       cu_seqlens=torch.tensor([0, 2], dtype=torch.int32), trajectory_index=[])


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
