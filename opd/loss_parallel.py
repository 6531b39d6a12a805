"""One chunk of the distillation loss over a vocabulary that may be sharded across a group.

`chunk_loss_and_grad` forms a chunk's student and teacher logits, their log-probs, the row
losses and the gradient of the student logits; opd.loss drives it chunk by chunk. Every
function here works on a chunk of rows ([C, V_local], fp32 or fp64) and takes an optional
`group`. With `group=None` the vocabulary is whole; with a process group, each rank holds an
equal, contiguous slice of it (rank r holds global columns [r * V_local, (r + 1) * V_local)),
and the only cross-rank traffic is per-row statistics of shape [C]: the max, the sum of
exponentials, the divergence terms. No rank ever holds a full row.

Conventions (as in TRL / Liger GKD): p is the student, q the teacher, both already divided by
the temperature. forward_kl = KL(q || p), reverse_kl = KL(p || q), jsd with 0 < beta < 1 is
beta * KL(q || m) + (1 - beta) * KL(p || m) with m = beta * q + (1 - beta) * p, and hybrid_kl is
KL(q || p) on rows where max q >= forward_kl_above and KL(p || q) on the others. The gradients
are d(row loss) / d(student logits / temperature); the caller applies the temperature and scale.

Speed comes from touching each [C, V] buffer as few times as possible, in place, in buffers
the caller reuses across chunks (a fresh CPU allocation of that size costs as much as an `exp`
pass, in page faults): a KL needs three [C, V] buffers, jsd four, a cross-entropy two. The
formulas are unmasked, so `0 * log 0` is NaN where a log-prob is -inf (a masked vocabulary
entry); the caller recomputes such a chunk with -inf replaced by the lowest finite value, where
every such product is an exact zero.
"""

import math

import torch
import torch.distributed as dist

from opd import divergences


def all_reduce_(tensor, op, group):
    """In-place all-reduce over the vocabulary group; nothing to do when the vocabulary is whole."""
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def shard_offset(vocab_width, group):
    """First global vocabulary column held by this rank."""
    return 0 if group is None else dist.get_rank(group) * vocab_width


def log_sum_exp(x_CV, group, scratch_CV):
    """Row-wise log(sum(exp(x))) over the whole (possibly sharded) vocabulary, shape [C]."""
    max_C1 = all_reduce_(x_CV.amax(-1, keepdim=True), dist.ReduceOp.MAX, group)
    max_C1.masked_fill_(~torch.isfinite(max_C1), 0.0)  # an all -inf row stays -inf, not NaN
    total_C1 = all_reduce_(torch.sub(x_CV, max_C1, out=scratch_CV).exp_().sum(-1, keepdim=True),
                           dist.ReduceOp.SUM, group)
    return total_C1.log_().add_(max_C1).squeeze(-1)


def log_softmax_(logits_CV, group, scratch_CV):
    """Turn `logits_CV` into log-probabilities in place (`scratch_CV` is used when sharded)."""
    if group is None:
        # The row-wise kernel reads a row before it writes it, so out= may be the input.
        return torch.log_softmax(logits_CV, -1, out=logits_CV)
    return logits_CV.sub_(log_sum_exp(logits_CV, group, scratch_CV)[:, None])


def _linear_into(out_CV, hidden_CH, weight_VH, bias_V, temperature):
    """(hidden @ weight.T + bias) / temperature written into `out_CV`."""
    if hidden_CH.dtype != out_CV.dtype:
        # bf16/fp16: the logits the model's own lm_head would give, then upcast, as the seed.
        out_CV.copy_(torch.nn.functional.linear(hidden_CH, weight_VH, bias_V))
        return out_CV.div_(temperature) if temperature != 1.0 else out_CV
    if temperature != 1.0:  # dividing the [C, H] input is cheaper than the [C, V] output
        hidden_CH = hidden_CH / temperature
        bias_V = None if bias_V is None else bias_V / temperature
    if bias_V is None:
        return torch.mm(hidden_CH, weight_VH.t(), out=out_CV)
    return torch.addmm(bias_V, hidden_CH, weight_VH.t(), out=out_CV)


def _gathered_logits(logits, rows, width, temperature, dtype):
    """The rows of full logits, a fresh tensor in the compute dtype, divided by the temperature."""
    logits_CV = logits[rows + (slice(None, width),)].to(dtype)  # indexing copies
    return logits_CV.div_(temperature) if temperature != 1.0 else logits_CV


def _teacher_logp(plan, rows, student_logp_CV, buffer_CV, scratch_CV):
    """Teacher log-probs of a chunk of rows, in `buffer_CV` when the teacher is not logits."""
    teacher, width = plan.teacher, plan.width
    if teacher.topk is not None:
        topk = teacher.topk
        return lift_topk_teacher(
            student_logp_CV, topk.token_ids[rows], topk.logprobs[rows], topk.rest_logprob[rows],
            plan.offset, plan.group, buffer_CV)
    if teacher.logits is not None:
        logits_CV = _gathered_logits(teacher.logits, rows, width, plan.temperature,
                                     buffer_CV.dtype)
    elif teacher.weight is not None:
        bias = None if teacher.bias is None else teacher.bias[:width]
        logits_CV = _linear_into(buffer_CV, teacher.hidden[rows], teacher.weight[:width], bias,
                                 plan.temperature)
    else:
        logits_CV = teacher.logits_fn(rows)
        if logits_CV.ndim != 2 or logits_CV.shape[0] != rows[0].numel() \
                or logits_CV.shape[1] < width:
            raise ValueError(f"teacher_logits_fn returned shape {tuple(logits_CV.shape)} for "
                             f"{rows[0].numel()} rows; expected [{rows[0].numel()}, >= {width}]")
        logits_CV = buffer_CV.copy_(logits_CV.detach()[:, :width])
        if plan.temperature != 1.0:
            logits_CV.div_(plan.temperature)
    return log_softmax_(logits_CV, plan.group, scratch_CV)


def chunk_loss_and_grad(student, weight, bias, plan, rows, workspace, need_grad, careful):
    """Row losses and d loss / d scaled student logits of one chunk, or None to retry carefully.

    `plan` is opd.loss's description of the call; `workspace` holds the [C, V] buffers the
    direction's registry entry counts (opd.divergences); `careful` replaces -inf log-probs by
    the lowest finite value first.
    """
    student_buffer, *others = workspace
    if weight is not None:
        logits_CV = _linear_into(student_buffer, student[rows], weight, bias, plan.temperature)
    else:
        logits_CV = _gathered_logits(student, rows, plan.width, plan.temperature,
                                     student_buffer.dtype)
    student_logp_CV = log_softmax_(logits_CV, plan.group, others[-1])
    if plan.labels is not None:
        return cross_entropy_rows(student_logp_CV, plan.labels[rows], plan.offset, plan.group,
                                  need_grad)
    teacher_buffer, *scratch = others
    teacher_logp_CV = _teacher_logp(plan, rows, student_logp_CV, teacher_buffer, scratch[0])
    if careful:
        lowest = torch.finfo(student_logp_CV.dtype).min
        student_logp_CV.clamp_(min=lowest)
        teacher_logp_CV.clamp_(min=lowest)
    return divergence_and_grad(student_logp_CV, teacher_logp_CV, scratch, plan, need_grad,
                               check_nan=not careful)


def divergence_and_grad(student_logp_CV, teacher_logp_CV, scratch, plan, need_grad, check_nan):
    """Row losses [C] (summed across the group) and d loss / d scaled student logits [C, V].

    Overwrites both log-probs and `scratch` (one [C, V] buffer, two for jsd and hybrid_kl); the
    gradient is one of them (None when `need_grad` is False). Returns None, before any gradient
    work, when `check_nan` is set and a loss came out NaN (see the module docstring). The kernel
    is the function of this module that opd.divergences names for `plan.direction`; it reads
    the direction's options (`plan.beta`, `plan.forward_kl_above`) and `plan.group`.
    """
    kernel = globals()[divergences.get(plan.direction).kernel]
    return kernel(student_logp_CV, teacher_logp_CV, scratch, plan, need_grad, check_nan)


def cross_entropy_rows(student_logp_CV, labels_C, offset, group, need_grad):
    """Row losses -log p(label) [C] and their gradients p - one_hot(label) [C, V_local].

    The forward KL to a one-hot teacher, read off directly: one gather instead of lifting a
    teacher. Labels are global ids; each rank contributes the labels in its own shard. The
    gradient overwrites the log-probs (None when `need_grad` is False).
    """
    rows, width = student_logp_CV.shape
    local_C = labels_C - offset
    owned_C = (local_C >= 0) & (local_C < width)
    column_C = local_C.clamp(0, width - 1)
    picked_C = student_logp_CV.gather(1, column_C[:, None]).squeeze(1)
    label_logp_C = all_reduce_(torch.where(owned_C, picked_C, 0.0), dist.ReduceOp.SUM, group)
    if not need_grad:
        return label_logp_C.neg_(), None
    grad_CV = student_logp_CV.exp_()
    owned_rows = torch.arange(rows, device=grad_CV.device)[owned_C]
    grad_CV[owned_rows, column_C[owned_C]] -= 1.0
    return label_logp_C.neg_(), grad_CV


def _row_sum(terms_CV, group):
    # torch's cascaded sum: an fp32 dot product over the vocabulary drifts by ~1e-5 relative.
    return all_reduce_(terms_CV.sum(-1), dist.ReduceOp.SUM, group)


def forward_kl_rows(logp_CV, logq_CV, scratch, plan, need_grad, check_nan):
    q_CV = torch.exp(logq_CV, out=scratch[0])
    loss_C = _row_sum(logq_CV.sub_(logp_CV).mul_(q_CV), plan.group)
    if check_nan and loss_C.isnan().any():
        return None
    return loss_C, logp_CV.exp_().sub_(q_CV) if need_grad else None


def reverse_kl_rows(logp_CV, logq_CV, scratch, plan, need_grad, check_nan):
    p_CV = torch.exp(logp_CV, out=scratch[0])
    terms_CV = torch.sub(logp_CV, logq_CV, out=logq_CV).mul_(p_CV)
    loss_C = _row_sum(terms_CV, plan.group)
    if check_nan and loss_C.isnan().any():
        return None
    # d/ds_j sum_k p_k (log p_k - log q_k) = p_j (log p_j - log q_j - loss)
    return loss_C, terms_CV.sub_(p_CV.mul_(loss_C[:, None])) if need_grad else None


def jsd_rows(logp_CV, logq_CV, scratch, plan, need_grad, check_nan):
    beta, group = plan.beta, plan.group
    mix_logp_CV, probs_CV = scratch[:2]
    # log m = log(1 - beta) + logaddexp(log q + log(beta / (1 - beta)), log p)
    torch.add(logq_CV, math.log(beta / (1.0 - beta)), out=mix_logp_CV)
    torch.logaddexp(mix_logp_CV, logp_CV, out=mix_logp_CV).add_(math.log(1.0 - beta))
    q_CV = torch.exp(logq_CV, out=probs_CV)
    teacher_part_C = _row_sum(logq_CV.sub_(mix_logp_CV).mul_(q_CV), group)
    p_CV = torch.exp(logp_CV, out=probs_CV)
    student_terms_CV = torch.sub(logp_CV, mix_logp_CV, out=mix_logp_CV).mul_(p_CV)
    student_part_C = _row_sum(student_terms_CV, group)
    if check_nan and (teacher_part_C.isnan().any() or student_part_C.isnan().any()):
        return None
    loss_C = beta * teacher_part_C + (1.0 - beta) * student_part_C
    if not need_grad:
        return loss_C, None
    # d loss / d p_j = (1 - beta)(log p_j - log m_j); through the softmax:
    # d/ds_j = (1 - beta) p_j (log p_j - log m_j - KL(p || m))
    grad_CV = student_terms_CV.sub_(p_CV.mul_(student_part_C[:, None]))
    return loss_C, grad_CV.mul_(1.0 - beta)


def hybrid_kl_rows(logp_CV, logq_CV, scratch, plan, need_grad, check_nan):
    """Forward KL on the rows where the teacher's top token has probability >= forward_kl_above,
    reverse KL on the others: the forward gradient p - q pulls up a token the student gives ~0
    (reverse KL's pull on it is ~p), and reverse KL keeps the student off the teacher's spread."""
    group = plan.group
    top_logq_C = all_reduce_(logq_CV.amax(-1), dist.ReduceOp.MAX, group)
    above = plan.forward_kl_above
    forward_C = top_logq_C >= (math.log(above) if above > 0 else -math.inf)
    q_CV, terms_CV = scratch[:2]
    torch.exp(logq_CV, out=q_CV)
    diff_CV = logq_CV.sub_(logp_CV)  # log q - log p
    p_CV = logp_CV.exp_()
    forward_kl_C = _row_sum(torch.mul(q_CV, diff_CV, out=terms_CV), group)
    reverse_kl_C = _row_sum(torch.mul(p_CV, diff_CV, out=terms_CV), group).neg_()
    if check_nan and (forward_kl_C.isnan().any() or reverse_kl_C.isnan().any()):
        return None
    loss_C = torch.where(forward_C, forward_kl_C, reverse_kl_C)
    if plan.counts is not None:
        plan.counts["forward_kl_tokens"] = plan.counts.get("forward_kl_tokens", 0.0) \
            + forward_C.sum(dtype=torch.float64)
    if not need_grad:
        return loss_C, None
    # forward rows: p - q; reverse rows: p (log p - log q - KL) = -p (log q - log p) - p KL.
    # As one expression with per-row coefficients: p * a - q * f - terms * r.
    forward_CV = forward_C.to(p_CV.dtype)[:, None]
    p_scale_CV = torch.where(forward_C, 1.0, -reverse_kl_C)[:, None]
    grad_CV = p_CV.mul_(p_scale_CV).addcmul_(q_CV, forward_CV, value=-1.0)
    return loss_C, grad_CV.addcmul_(terms_CV, 1.0 - forward_CV, value=-1.0)


def lift_topk_teacher(student_logp_CV, token_ids_CK, logprobs_CK, rest_logprob_C, offset, group,
                      out_CV):
    """Teacher log-probs over the full (local) vocabulary from its top-k plus remaining mass.

    The teacher's remaining mass is spread over the non-top-k tokens in proportion to the
    student's own probabilities. Any divergence of the student against this lifted teacher
    equals, in value and in gradient, the divergence between the two distributions coarsened to
    k + 1 outcomes (the k tokens and "everything else"), which by the data-processing
    inequality never exceeds the full-vocabulary divergence: the sparse loss is a lower bound.
    """
    rows, width = student_logp_CV.shape
    local_ids_CK = token_ids_CK - offset
    owned_CK = (local_ids_CK >= 0) & (local_ids_CK < width)  # the other ids live on other ranks
    row_ids_CK = torch.arange(rows, device=local_ids_CK.device)[:, None].expand_as(local_ids_CK)
    topk_index = (row_ids_CK[owned_CK], local_ids_CK[owned_CK])
    in_topk_CV = torch.zeros(rows, width, dtype=torch.bool, device=student_logp_CV.device)
    in_topk_CV.index_put_(topk_index, torch.tensor(True, device=in_topk_CV.device))
    # log of the student's mass outside the top-k, through -inf masking (no 1 - sum cancellation)
    out_CV.copy_(student_logp_CV).masked_fill_(in_topk_CV, -math.inf)
    student_rest_logp_C = log_sum_exp(out_CV, group, out_CV)
    shift_C = rest_logprob_C.to(out_CV.dtype) - student_rest_logp_C
    # No student mass outside the top-k: the lifted rest stays at the student's -inf.
    shift_C.masked_fill_(~torch.isfinite(student_rest_logp_C), 0.0)
    torch.add(student_logp_CV, shift_C[:, None], out=out_CV)
    out_CV.index_put_(topk_index, logprobs_CK[owned_CK].to(out_CV.dtype))
    return out_CV
