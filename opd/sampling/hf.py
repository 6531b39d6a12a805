"""`rollout.engine: hf`: the training engine's own student samples, through opd.rollout's
batched KV-cache loop.

`student.generation_gather: once` gathers the sharded student once per rollout (ZeRO-3: the
whole model; FSDP2: unsharded) and samples without collectives; `per_step` gathers layer by
layer inside every forward, so ranks must run the same number of forwards: a rank whose
conversations ended early runs one-token dummy forwards until all are done (`lockstep`).
"""

from __future__ import annotations

from collections.abc import Sequence

from opd.dist import lockstep
from opd.rollout import rollout
from opd.sampling.base import OnFinished, Sampler
from opd.trajectory import AgentTrajectory


class HFSampler(Sampler):
    def sample(self, prompts: Sequence[dict], seed: int,
               on_finished: OnFinished | None = None) -> list[AgentTrajectory]:
        context = self.context
        gather = context.config.student.generation_gather == "once"
        sync = lockstep() if context.world.distributed and not gather else None
        with context.student.generation_context(gather) as model:
            return rollout(model, context.chat, context.executor, prompts,
                           context.config.rollout, seed=seed, parser=context.parser, sync=sync,
                           vocab_size=context.vocab_size, on_finished=on_finished)
