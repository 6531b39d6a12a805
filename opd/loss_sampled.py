"""Sampled-token reverse KL in policy-gradient form, plus a task reward (sampled_reverse_kl).

What tinker's on-policy distillation, slime, verl and NeMo-RL's OPD optimise: the teacher is
read only at the token the student sampled, so a served teacher that returns one log-prob per
token suffices. Per target token t with sampled token y_t (the label: the token position t
predicts), all log-probs at `temperature`:
    s_t = log p(y_t)   the learner's log-prob, the only term with a gradient
    q_t = log q(y_t)   the teacher's (teacher_logprobs; none when distill_weight = 0)
    b_t = log mu(y_t)  the sampler's, recorded at rollout (sampler_logprobs, optional)
    A_t                the task reward's advantage of the token's episode (advantages; zero on
                       prompt and tool-observation tokens, see opd.rewards)
    d_t = s_t - q_t    the log-ratio; k1_t = d_t and k3_t = exp(-d_t) - 1 + d_t are the two
                       usual per-token estimates of KL(p || q) (both unbiased for its value
                       when y_t ~ p; k3 >= 0 and has the lower variance).

Per-token advantage (detached), optionally clipped to [-advantage_clip, advantage_clip]:
    a_t = reward_weight * A_t - distill_weight * g_t
    k1: g_t = d_t                 policy-gradient form: E_{y~p}[d(y) grad log p(y)] is exactly
                                  grad KL(p || q) at the same prefix, the full-vocabulary
                                  reverse_kl direction's gradient, in expectation.
    k3: g_t = 1 - exp(q_t - s_t)  k3_t differentiated as a loss through s_t (verl's
                                  low_var_kl / NeMo-RL's k3 loss): d k3 / d s = 1 - q/p, so
                                  E_{y~p}[(1 - q(y)/p(y)) grad log p(y)] = sum_y p grad log p
                                  - sum_y q grad log p = 0 + grad KL(q || p): the FORWARD KL's
                                  gradient, not the reverse KL's (low variance, mass-covering).
Truncated importance weight (detached; tinker / slime / NeMo-RL), for tokens drawn from the
sampler mu rather than from the learner p (numerics, stale weights, another engine):
    w_t = min(exp(s_t - b_t), importance_cap)   (importance_cap = 0: w_t = 1, no correction;
                                                 the sampler's log-probs then only feed the
                                                 mismatch statistics)
Loss (summed over target tokens, or their mean with reduction="mean"; times temperature ** 2 as
every loss in opd.loss):
    L = T**2 * sum_t -w_t * a_t * exp(s_t - sg(s_t))
whose value is -sum_t w_t a_t (with reward_weight 0, k1 and no clip: the importance-weighted k1
estimate of KL(p || q)) and whose gradient is T**2 * sum_t w_t * a_t * grad(-s_t): a
cross-entropy of the labels weighted per token by w_t * a_t. That is how it runs:
opd.loss.fused_cross_entropy_loss with row weights, the same chunked pass from hidden states (no
[N, V] tensor; ZeRO-3 constraints as in opd.loss), whose gradient of -log p(y) with respect to
the logits is softmax - one_hot(y).

Statistics: `fused_sampled_kl_loss` also returns per-call sums and maxima (STAT_REDUCTIONS says
which), float64 scalars the trainer adds over micro-batches (`accumulate_stats`), all-reduces and
turns into per-token figures (`summarize_stats`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from opd.loss import fused_cross_entropy_loss

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

ESTIMATORS = ("k1", "k3")
# How each statistic combines across micro-batches and ranks.
STAT_REDUCTIONS = {
    "tokens": "sum",
    "kl_k1_sum": "sum",  # sum of d_t (needs the teacher)
    "kl_k3_sum": "sum",  # sum of k3_t (needs the teacher)
    "importance_ratio_sum": "sum",  # exp(s_t - b_t) before truncation (1 without b_t)
    "importance_ratio_max": "max",
    "truncated_tokens": "sum",  # exp(s_t - b_t) > importance_cap
    "clipped_tokens": "sum",  # |a_t| > advantage_clip
    "advantage_sum": "sum",  # a_t after clipping
    "advantage_square_sum": "sum",
    "logprob_gap_sum": "sum",  # |s_t - b_t| (0 without b_t)
    "logprob_gap_max": "max",
}


class _SampledRows:
    """Row weights for fused_cross_entropy_loss: a_t and w_t of each chunk, and the statistics."""

    def __init__(self, mask, teacher, sampler, advantages, estimator, distill_weight,
                 reward_weight, importance_cap, advantage_clip):
        def targets(tensor):
            return None if tensor is None else tensor.detach()[mask].double()

        self.teacher_R, self.sampler_R = targets(teacher), targets(sampler)
        self.advantage_R = targets(advantages)
        self.estimator, self.distill_weight, self.reward_weight = \
            estimator, distill_weight, reward_weight
        self.importance_cap, self.advantage_clip = importance_cap, advantage_clip
        self.stats = {name: torch.zeros((), dtype=torch.float64, device=mask.device)
                      for name in STAT_REDUCTIONS}

    def __call__(self, cross_entropy_C, start, stop):
        stats = self.stats
        learner_C = -cross_entropy_C.detach().double()
        advantage_C = torch.zeros_like(learner_C)
        if self.teacher_R is not None:
            ratio_C = learner_C - self.teacher_R[start:stop]
            k3_C = torch.expm1(-ratio_C).add_(ratio_C)
            stats["kl_k1_sum"] += ratio_C.sum()
            stats["kl_k3_sum"] += k3_C.sum()
            slope_C = ratio_C if self.estimator == "k1" else -torch.expm1(-ratio_C)
            advantage_C -= self.distill_weight * slope_C
        if self.advantage_R is not None and self.reward_weight:
            advantage_C += self.reward_weight * self.advantage_R[start:stop]
        if self.advantage_clip:
            stats["clipped_tokens"] += (advantage_C.abs() > self.advantage_clip).sum()
            advantage_C.clamp_(-self.advantage_clip, self.advantage_clip)
        ratio_C = torch.ones_like(learner_C)
        if self.sampler_R is not None:
            gap_C = learner_C - self.sampler_R[start:stop]
            ratio_C = gap_C.exp()
            stats["logprob_gap_sum"] += gap_C.abs().sum()
            stats["logprob_gap_max"] = torch.maximum(stats["logprob_gap_max"], gap_C.abs().max())
        stats["importance_ratio_sum"] += ratio_C.sum()
        stats["importance_ratio_max"] = torch.maximum(stats["importance_ratio_max"],
                                                      ratio_C.max())
        weight_C = torch.ones_like(learner_C)
        if self.importance_cap:
            stats["truncated_tokens"] += (ratio_C > self.importance_cap).sum()
            weight_C = ratio_C.clamp(max=self.importance_cap)
        stats["tokens"] += learner_C.numel()
        stats["advantage_sum"] += advantage_C.sum()
        stats["advantage_square_sum"] += advantage_C.square().sum()
        coefficient_C = (weight_C * advantage_C).to(cross_entropy_C.dtype)
        return -coefficient_C, coefficient_C


def fused_sampled_kl_loss(
        student_hidden: torch.Tensor, student_lm_head_weight: torch.Tensor,
        labels: torch.Tensor, target_mask: torch.Tensor | None,
        teacher_logprobs: torch.Tensor | None, *, sampler_logprobs: torch.Tensor | None = None,
        advantages: torch.Tensor | None = None, student_bias: torch.Tensor | None = None,
        vocab_size: int | None = None, chunk_size: int | None = None, temperature: float = 1.0,
        estimator: str = "k1", distill_weight: float = 1.0, reward_weight: float = 0.0,
        importance_cap: float = 0.0, advantage_clip: float = 0.0, reduction: str = "sum",
        vocab_parallel_group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The module docstring's L, and its statistics, from hidden states.

    student_hidden [..., H], student_lm_head_weight [V, H] (student_bias [V]); labels [...]: the
    sampled token each position predicts; target_mask [...] bool (all when None);
    teacher_logprobs, sampler_logprobs, advantages [...] floats, read at target positions only.
    Gradients flow to the hidden states, the lm_head and the bias.
    """
    lead = tuple(labels.shape)
    named = {"teacher_logprobs": teacher_logprobs, "sampler_logprobs": sampler_logprobs,
             "advantages": advantages}
    for name, tensor in named.items():
        if tensor is not None and (tuple(tensor.shape) != lead
                                   or not tensor.is_floating_point()):
            raise ValueError(f"{name} {tuple(tensor.shape)} must be floats of the labels' shape "
                             f"{lead}, one per sampled token")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if distill_weight < 0 or reward_weight < 0 or distill_weight == reward_weight == 0:
        raise ValueError(f"distill_weight ({distill_weight}) and reward_weight ({reward_weight}) "
                         f"must be at least 0 and not both 0")
    if (teacher_logprobs is None) != (distill_weight == 0):
        raise ValueError("teacher_logprobs are needed exactly when distill_weight > 0, got "
                         f"{'none' if teacher_logprobs is None else 'some'} with distill_weight "
                         f"{distill_weight}")
    if reward_weight and advantages is None:
        raise ValueError(f"advantages are needed when reward_weight > 0, got reward_weight "
                         f"{reward_weight} and no advantages")
    if importance_cap < 0 or advantage_clip < 0:
        raise ValueError(f"importance_cap ({importance_cap}) and advantage_clip "
                         f"({advantage_clip}) must be at least 0 (0 turns them off)")
    mask = torch.ones(lead, dtype=torch.bool, device=labels.device) if target_mask is None \
        else target_mask
    if tuple(mask.shape) != lead or mask.dtype != torch.bool:
        raise ValueError(f"Target mask {tuple(mask.shape)} {mask.dtype} must be bool and match "
                         f"the labels {lead}")
    rows = _SampledRows(mask, teacher_logprobs, sampler_logprobs, advantages, estimator,
                        float(distill_weight), float(reward_weight), float(importance_cap),
                        float(advantage_clip))
    loss = fused_cross_entropy_loss(
        student_hidden, student_lm_head_weight, labels, mask, student_bias=student_bias,
        vocab_size=vocab_size, chunk_size=chunk_size, temperature=temperature,
        reduction=reduction, row_weights=rows, vocab_parallel_group=vocab_parallel_group)
    return loss, rows.stats


def accumulate_stats(total: dict[str, torch.Tensor] | None,
                     stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`total` with one more call's statistics folded in (sums added, maxima kept)."""
    if total is None:
        return {name: value.clone() for name, value in stats.items()}
    for name, how in STAT_REDUCTIONS.items():
        total[name] = total[name] + stats[name] if how == "sum" \
            else torch.maximum(total[name], stats[name])
    return total


def summarize_stats(stats: dict[str, float]) -> dict[str, float]:
    """Per-token figures of (all-reduced) statistics, for metrics.jsonl."""
    tokens = max(stats["tokens"], 1.0)
    mean = stats["advantage_sum"] / tokens
    return {
        "kl_k1": stats["kl_k1_sum"] / tokens,
        "kl_k3": stats["kl_k3_sum"] / tokens,
        "importance_ratio_mean": stats["importance_ratio_sum"] / tokens,
        "importance_ratio_max": stats["importance_ratio_max"],
        "truncated_fraction": stats["truncated_tokens"] / tokens,
        "clipped_fraction": stats["clipped_tokens"] / tokens,
        "advantage_mean": mean,
        "advantage_std": max(stats["advantage_square_sum"] / tokens - mean * mean, 0.0) ** 0.5,
        "logprob_gap_mean": stats["logprob_gap_sum"] / tokens,
        "logprob_gap_max": stats["logprob_gap_max"],
    }
