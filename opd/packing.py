"""Trajectories -> model inputs: seed-compatible padding and varlen packing.

Varlen packing concatenates whole trajectories into one row per micro-batch, with position ids
restarting at 0 for each sequence. That is the form flash-attn's varlen kernels read through
`cu_seqlens` and the form transformers detects as packed (block-diagonal causal attention) when
neither an attention mask nor a KV cache is passed (`use_cache=False`), so no compute is spent on
padding.

Alignment: logits at position i predict token i+1, so the packed target mask marks position i
when token i+1 is a student-written token *of the same sequence*; the last position of each
sequence never predicts anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _check_trajectories(trajectories: Sequence) -> None:
    if not trajectories:
        raise ValueError("At least one trajectory is required")
    if any(len(t.input_ids) != len(t.assistant_mask) for t in trajectories):
        raise ValueError("Trajectory tokens and masks must have the same length")


def pack_trajectories(trajectories, pad_token_id, device):
    """Seed-compatible right-padded batch: (input_ids [B,T], attention_mask [B,T], targets [B,T-1])."""
    _check_trajectories(trajectories)
    length = max(len(t.input_ids) for t in trajectories)
    ids, attention, targets = [], [], []
    for trajectory in trajectories:
        size = len(trajectory.input_ids)
        ids.append(list(trajectory.input_ids) + [pad_token_id] * (length - size))
        attention.append([1] * size + [0] * (length - size))
        targets.append(list(trajectory.assistant_mask) + [False] * (length - size))
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(attention, dtype=torch.long, device=device),
        torch.tensor(targets, dtype=torch.bool, device=device)[:, 1:],
    )


@dataclass
class PackedBatch:
    """One varlen micro-batch: S sequences concatenated into N tokens."""

    input_ids: torch.Tensor  # [1, N] long
    position_ids: torch.Tensor  # [1, N] long, restarting at 0 per sequence
    target_mask: torch.Tensor  # [1, N] bool: logits at i predict a target token i+1
    cu_seqlens: torch.Tensor  # [S+1] int32, sequence boundaries (flash-attn varlen form)
    trajectory_index: list[int]  # packed sequence s is trajectories[trajectory_index[s]]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_targets(self) -> int:
        return int(self.target_mask.sum())

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def to(self, device) -> PackedBatch:
        return PackedBatch(self.input_ids.to(device), self.position_ids.to(device),
                           self.target_mask.to(device), self.cu_seqlens.to(device),
                           self.trajectory_index)

    def unpack(self, values_N: torch.Tensor) -> dict[int, torch.Tensor]:
        """Split per-position values [N, ...] back into {trajectory index: values [T_i, ...]}."""
        bounds = self.cu_seqlens.tolist()
        return {index: values_N[bounds[s]:bounds[s + 1]]
                for s, index in enumerate(self.trajectory_index)}


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, longest first into the first bin with room (each bin <= capacity)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[index] <= free:
                bins[b].append(index)
                room[b] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(capacity - lengths[index])
    return bins


def pack_varlen(trajectories, max_tokens: int) -> list[PackedBatch]:
    """Pack trajectories into micro-batches of at most `max_tokens` tokens (first-fit decreasing)."""
    _check_trajectories(trajectories)
    lengths = [len(t.input_ids) for t in trajectories]
    if max(lengths) > max_tokens:
        raise ValueError(
            f"A trajectory of {max(lengths)} tokens exceeds packing.max_tokens={max_tokens}; "
            "set packing.max_tokens to at least rollout.max_total_len")
    return [_pack_bin([trajectories[i] for i in members], members)
            for members in first_fit_decreasing(lengths, max_tokens)]


def _pack_bin(trajectories: Sequence, indices: list[int]) -> PackedBatch:
    ids: list[int] = []
    positions: list[int] = []
    targets: list[bool] = []
    bounds = [0]
    for trajectory in trajectories:
        size = len(trajectory.input_ids)
        ids.extend(trajectory.input_ids)
        positions.extend(range(size))
        targets.extend(list(trajectory.assistant_mask[1:]) + [False])
        bounds.append(bounds[-1] + size)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        target_mask=torch.tensor([targets], dtype=torch.bool),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        trajectory_index=list(indices),
    )


def empty_micro_batch(pad_token_id: int) -> PackedBatch:
    """Two tokens, no targets: a rank with fewer micro-batches runs these to stay in lockstep."""
    return PackedBatch(input_ids=torch.full((1, 2), pad_token_id, dtype=torch.long),
                       position_ids=torch.arange(2)[None],
                       target_mask=torch.zeros((1, 2), dtype=torch.bool),
                       cu_seqlens=torch.tensor([0, 2], dtype=torch.int32), trajectory_index=[])


def per_target(batch: PackedBatch, values: Sequence[torch.Tensor], fill: float = 0.0
               ) -> torch.Tensor:
    """[N, ...] values of a micro-batch from each packed conversation's per-target values
    (`values[s]` holds one row per target token of sequence s, in order; `fill` elsewhere), on
    the batch's device."""
    rows = batch.target_mask[0].nonzero().squeeze(-1)
    joined = (torch.cat(list(values)) if len(values) else torch.zeros(0)).to(rows.device)
    if len(joined) != len(rows):
        raise RuntimeError(f"{len(joined)} per-token values for the {len(rows)} target tokens "
                           "of a micro-batch: nothing trains on a partial payload")
    out = torch.full((batch.num_tokens, *joined.shape[1:]), fill, dtype=joined.dtype,
                     device=rows.device)
    out[rows] = joined
    return out
