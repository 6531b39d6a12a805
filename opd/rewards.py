"""Task rewards -> per-token advantages: group normalisation (GRPO-style) and the broadcast.

`rollout.samples_per_prompt` samples a group of episodes per prompt; the world's checker scores
each finished episode into a reward r_i. Within a group of G episodes (loss.advantage_norm):
    mean_std       A_i = (r_i - mean(r)) / (std(r) + eps)   GRPO; std with G - 1 (torch.std,
                                                            as TRL and verl)
    mean           A_i = r_i - mean(r)                      Dr. GRPO (no std division)
    leave_one_out  A_i = r_i - mean_{j != i}(r_j)           RLOO = G / (G - 1) * (r_i - mean)
    none           A_i = r_i                                the raw reward, no baseline
A group of one has no baseline: its advantage is 0 under every norm but `none`. A group whose
rewards are all equal gets 0 everywhere (mean_std divides 0 by eps).
An episode's advantage then applies to its assistant (target) tokens only: prompt and
tool-observation tokens get exactly 0 (`token_advantages`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

ADVANTAGE_NORMS = ("mean_std", "mean", "leave_one_out", "none")
STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], groups: Sequence[Hashable],
                     norm: str = "mean_std", eps: float = STD_EPS) -> list[float]:
    """The advantage of each episode; `groups[i]` names episode i's prompt (any hashable)."""
    if norm not in ADVANTAGE_NORMS:
        raise ValueError(f"advantage norm must be one of {', '.join(ADVANTAGE_NORMS)}, got "
                         f"{norm!r}")
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards and {len(groups)} group ids must pair up, one "
                         f"per episode")
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        values = [float(rewards[i]) for i in indices]
        size = len(values)
        if norm == "none":
            for i, value in zip(indices, values):
                advantages[i] = value
            continue
        if size == 1:
            continue
        mean = sum(values) / size
        scale = 1.0
        if norm == "mean_std":
            std = (sum((v - mean) ** 2 for v in values) / (size - 1)) ** 0.5
            scale = 1.0 / (std + eps)
        elif norm == "leave_one_out":
            scale = size / (size - 1)
        for i, value in zip(indices, values):
            advantages[i] = (value - mean) * scale
    return advantages


def token_advantages(episode_advantages: Sequence[float], cu_seqlens: torch.Tensor,
                     trajectory_index: Sequence[int], target_mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages [..., N] of one packed micro-batch: each sequence's episode
    advantage on its target positions, exactly 0 elsewhere.

    `cu_seqlens` [S + 1] bounds the S packed sequences, `trajectory_index[s]` is sequence s's
    episode (index into `episode_advantages`), `target_mask` [..., N] marks the positions that
    predict an assistant token (opd.packing.PackedBatch's fields).
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    tokens = target_mask.shape[-1]
    if len(trajectory_index) != lengths.numel() or int(cu_seqlens[-1]) != tokens:
        raise ValueError(f"{len(trajectory_index)} trajectory ids and cu_seqlens ending at "
                         f"{int(cu_seqlens[-1])} must describe the {lengths.numel()} sequences "
                         f"of the {tokens} packed tokens")
    per_sequence = torch.tensor([float(episode_advantages[i]) for i in trajectory_index],
                                dtype=torch.float32, device=target_mask.device)
    per_token = per_sequence.repeat_interleave(lengths.to(target_mask.device))
    return torch.where(target_mask, per_token.expand_as(target_mask), 0.0)
