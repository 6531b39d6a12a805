"""Naive references for opd.loss: every [tokens, vocab] tensor in memory, autograd for gradients.

`distillation_loss` is the seed's function verbatim (shared/seed/agent_opd.py).
"""

import math

import torch
import torch.nn.functional as F


def distillation_loss(student_logits, teacher_logits, target_mask,
                      temperature=1.0, direction="forward_kl"):
    """Full-vocabulary KL averaged over assistant tokens on sampled prefixes.

    Sampling is detached (the GKD semi-gradient); this is not a REINFORCE
    estimator of trajectory-level reverse KL. Teacher gradients are blocked.
    """
    if student_logits.shape != teacher_logits.shape or student_logits.ndim != 3:
        raise ValueError("Student and teacher logits must share [batch, time, vocab]")
    if target_mask.shape != student_logits.shape[:2]:
        raise ValueError("Target mask must align with the shifted logits")
    if temperature <= 0 or direction not in {"forward_kl", "reverse_kl"}:
        raise ValueError("Invalid distillation temperature or KL direction")
    if not target_mask.any():
        return student_logits[:, :0, :].sum()
    student_logps = F.log_softmax(student_logits[target_mask].float() / temperature, dim=-1)
    teacher_logps = F.log_softmax(teacher_logits.detach()[target_mask].float() / temperature, dim=-1)
    if direction == "forward_kl":
        loss = F.kl_div(student_logps, teacher_logps, log_target=True, reduction="batchmean")
    else:
        loss = F.kl_div(teacher_logps, student_logps, log_target=True, reduction="batchmean")
    return loss * temperature ** 2


def _kl_rows(logp, logq):
    """KL(p || q) per row with 0 * log 0 = 0."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def generalized_jsd(student_logits, teacher_logits, target_mask, temperature=1.0, beta=0.5):
    """TRL's generalised JSD (beta = 0: KL(teacher || student), 1: KL(student || teacher)), mean."""
    logp = F.log_softmax(student_logits[target_mask].double() / temperature, dim=-1)
    logq = F.log_softmax(teacher_logits.detach()[target_mask].double() / temperature, dim=-1)
    if beta == 0:
        rows = _kl_rows(logq, logp)
    elif beta == 1:
        rows = _kl_rows(logp, logq)
    else:
        logm = torch.logsumexp(torch.stack([logq + math.log(beta), logp + math.log(1 - beta)]), 0)
        rows = beta * _kl_rows(logq, logm) + (1 - beta) * _kl_rows(logp, logm)
    return rows.mean() * temperature ** 2


def hybrid_kl(student_logits, teacher_logits, target_mask, temperature=1.0, forward_kl_above=0.9):
    """KL(teacher || student) on rows where the teacher's top probability >= forward_kl_above,
    KL(student || teacher) on the others, mean over target rows, times T ** 2."""
    logp = F.log_softmax(student_logits[target_mask].double() / temperature, dim=-1)
    logq = F.log_softmax(teacher_logits.detach()[target_mask].double() / temperature, dim=-1)
    forward = logq.exp().amax(-1) >= forward_kl_above
    rows = torch.where(forward, _kl_rows(logq, logp), _kl_rows(logp, logq))
    return rows.mean() * temperature ** 2


def coarse_topk_divergence(student_logits, teacher_logits, target_mask, k, temperature=1.0,
                           direction="forward_kl"):
    """Divergence between student and teacher coarsened to the teacher's top k tokens + the rest."""
    logp = F.log_softmax(student_logits[target_mask].double() / temperature, dim=-1)
    logq = F.log_softmax(teacher_logits.detach()[target_mask].double() / temperature, dim=-1)
    top_ids = logq.topk(k, dim=-1).indices
    in_top = torch.zeros_like(logq, dtype=torch.bool).scatter_(1, top_ids, True)

    def coarse(logx):
        rest = logx.masked_fill(in_top, -math.inf).logsumexp(-1, keepdim=True)
        return torch.cat([logx.gather(1, top_ids), rest], dim=-1)

    coarse_p, coarse_q = coarse(logp), coarse(logq)
    if direction == "forward_kl":
        rows = _kl_rows(coarse_q, coarse_p)
    else:
        rows = _kl_rows(coarse_p, coarse_q)
    return rows.mean() * temperature ** 2


def cross_entropy(student_logits, labels, target_mask, temperature=1.0):
    """SFT: mean negative log-likelihood of the labels at target positions, times T ** 2."""
    logp = F.log_softmax(student_logits[target_mask].double() / temperature, dim=-1)
    return F.nll_loss(logp, labels[target_mask]) * temperature ** 2


def sampled_kl_surrogate(student_logits, labels, target_mask, teacher_logprobs,
                         sampler_logprobs=None, advantages=None, temperature=1.0, estimator="k1",
                         distill_weight=1.0, reward_weight=0.0, importance_cap=0.0,
                         advantage_clip=0.0):
    """opd.loss_sampled's L, token by token through autograd: sum_t -w_t a_t exp(s_t - sg(s_t))."""
    logp = F.log_softmax(student_logits[target_mask].double() / temperature, dim=-1)
    learner = logp.gather(-1, labels[target_mask][:, None]).squeeze(-1)
    fixed = learner.detach()
    advantage = torch.zeros_like(fixed)
    if distill_weight:
        log_ratio = fixed - teacher_logprobs[target_mask].double()
        slope = log_ratio if estimator == "k1" else 1 - torch.exp(-log_ratio)
        advantage = advantage - distill_weight * slope
    if reward_weight:
        advantage = advantage + reward_weight * advantages[target_mask].double()
    if advantage_clip:
        advantage = advantage.clamp(-advantage_clip, advantage_clip)
    weight = torch.ones_like(fixed)
    if importance_cap:
        weight = torch.exp(fixed - sampler_logprobs[target_mask].double()).clamp(max=importance_cap)
    return -(weight * advantage * torch.exp(learner - fixed)).sum() * temperature ** 2
