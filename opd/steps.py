"""What optimizer step `step` (1-based) trains on and at which learning rate.

Every function here is a pure function of the config, the step and the rank, so a resumed run
repeats the steps of an uninterrupted one exactly, and every rank draws the same off-policy
decision without a collective.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TypeVar

from opd.config import Config, OptimConfig

Record = TypeVar("Record")  # a dataset record or an already rendered trajectory


def schedule_factor(step: int, total_steps: int, warmup_steps: int, schedule: str,
                    floor: float) -> float:
    """Linear warmup to 1 over `warmup_steps`, then cosine or linear decay to `floor`, or
    constant (1-based `step`)."""
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return floor + (1 - floor) * decay


def learning_rate(step: int, optim: OptimConfig, total_steps: int) -> float:
    return optim.lr * schedule_factor(step, total_steps, optim.warmup_steps, optim.schedule,
                                      optim.min_lr_ratio)


def step_records(records: Sequence[Record], step: int, config: Config, rank: int,
                 world_size: int, orders: dict[int, list[int]]) -> list[Record]:
    """This rank's share of step `step`'s records: a seeded shuffle per epoch, dealt round-robin.

    `orders` caches each epoch's order (epoch -> shuffled indices) between calls.
    """
    per_step = config.train.prompts_per_step
    picked = []
    for position in range((step - 1) * per_step, step * per_step):
        epoch, index = divmod(position, len(records))
        if epoch not in orders:
            order = list(range(len(records)))
            random.Random(f"order/{config.seed}/{epoch}").shuffle(order)
            orders[epoch] = order
        picked.append(records[orders[epoch][index]])
    return picked[rank::world_size]


def off_policy(config: Config, step: int) -> bool:
    """Whether step `step` trains on dataset completions (loss.off_policy_fraction)."""
    fraction = config.loss.off_policy_fraction
    return fraction > 0 and random.Random(f"gkd/{config.seed}/{step}").random() < fraction


def rollout_seed(config: Config, step: int, rank: int) -> int:
    return (config.seed * 1_000_003 + step) * 4099 + rank
