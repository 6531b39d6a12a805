"""Supervised fine-tuning on whole conversations, the loss on assistant tokens only.

Conversations come as `AgentTrajectory`s from `opd.data.completion_trajectory`, so the teacher
and the student's warm start learn exactly the IDs a rollout holds (turn-closing stop token
included), never a re-tokenisation of them.

Two savings make CPU minutes count: batches are drawn from length-sorted windows (little
padding), and the system prompt every conversation starts with runs once per step as a batch of
one whose keys and values are broadcast to the batch (gradients flow through the broadcast).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

from opd.steps import schedule_factor

SORT_WINDOW = 8  # batches per length-sorted window


def shared_prefix_length(trajectories: Sequence) -> int:
    """How many leading tokens all conversations share, leaving each at least one more."""
    first = trajectories[0].input_ids
    limit = min(len(t.input_ids) for t in trajectories) - 1
    length = 0
    while length < limit and all(t.input_ids[length] == first[length] for t in trajectories):
        length += 1
    return length


def batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless shuffled epochs; each window of SORT_WINDOW batches is sorted by length first."""
    while True:
        order = rng.sample(range(len(lengths)), len(lengths))
        window = batch_size * SORT_WINDOW
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lengths.__getitem__)
            group = [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
            rng.shuffle(group)
            yield from group


def sft_loss(model, input_ids_BT, attention_mask_BT, targets_BT, prefix_length: int = 0):
    """Mean cross-entropy of the target tokens (targets_BT marks positions predicting a target).

    The LM head runs on target positions only. The first `prefix_length` tokens must be the same
    in every row: they run once and their keys/values are broadcast.
    """
    import torch
    import torch.nn.functional as F

    if prefix_length:
        hidden_BTD = _forward_with_shared_prefix(model, input_ids_BT, attention_mask_BT,
                                                 prefix_length)
    else:
        hidden_BTD = model.model(input_ids=input_ids_BT, attention_mask=attention_mask_BT)[0]
    logits_NV = model.lm_head(hidden_BTD[:, :-1][targets_BT])
    return F.cross_entropy(logits_NV.float(), input_ids_BT[:, 1:][targets_BT].to(torch.long))


def _forward_with_shared_prefix(model, input_ids_BT, attention_mask_BT, prefix_length: int):
    import torch

    from opd.rollout import cache_argument_name  # heavy: torch, as above

    batch, length = input_ids_BT.shape
    cache_name = cache_argument_name(model.model)
    prefix = model.model(input_ids=input_ids_BT[:1, :prefix_length], use_cache=True)
    cache = prefix[cache_name]
    for layer in cache.layers:
        layer.keys = layer.keys.expand(batch, -1, -1, -1)
        layer.values = layer.values.expand(batch, -1, -1, -1)
    positions_BT = torch.arange(prefix_length, length, device=input_ids_BT.device)
    rest = model.model(input_ids=input_ids_BT[:, prefix_length:],
                       attention_mask=attention_mask_BT,
                       position_ids=positions_BT.expand(batch, -1), use_cache=False,
                       **{cache_name: cache})
    return torch.cat([prefix[0].expand(batch, -1, -1), rest[0]], dim=1)


def sft(model, trajectories: list, *, steps: int, batch_size: int, lr: float, warmup_steps: int,
        seed: int, desc: str, schedule: str = "cosine", pad_token_id: int = 0,
        every: int = 0, on_every: Callable[[int], None] | None = None) -> list[float]:
    """Train `model` in place for `steps` AdamW steps; returns the per-step losses.

    `on_every(step)` runs after every `every` steps (an eval along one schedule); the model is
    in eval mode during the call."""
    import torch
    from tqdm import tqdm

    from opd.packing import pack_trajectories  # heavy: torch, as above

    device = next(model.parameters()).device
    prefix_length = shared_prefix_length(trajectories)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: schedule_factor(step + 1, steps, warmup_steps, schedule, 0.1))
    draw = batches([len(t.input_ids) for t in trajectories], batch_size, random.Random(seed))
    losses = []
    model.train()
    for _ in (bar := tqdm(range(steps), desc=desc, unit="step", leave=False)):
        batch = [trajectories[i] for i in next(draw)]
        input_ids_BT, attention_mask_BT, targets_BT = pack_trajectories(batch, pad_token_id, device)
        loss = sft_loss(model, input_ids_BT, attention_mask_BT, targets_BT, prefix_length)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_every and every and len(losses) % every == 0:
            model.eval()
            on_every(len(losses))
            model.train()
    model.eval()
    return losses
