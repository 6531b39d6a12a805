"""Token-level distillation losses that never hold a [tokens, vocab] tensor in fp32.

One implementation serves every entry point: `_ChunkedDistillation`, a custom autograd
function that selects the target rows first (non-target tokens cost nothing), walks them in
chunks of `chunk_size` rows, and for each chunk forms the student and teacher logits, computes
the row losses and the gradient of the student logits, and folds that gradient straight into
what the inputs need: the rows of a logits gradient, or d hidden and d lm_head (and d bias) when
the logits come from hidden states. Backward is then only a scale. Peak extra memory is three
(jsd: four, cross-entropy: two) [chunk, vocab] fp32 buffers, reused by every chunk, plus
gradients the size of the inputs: [N, H] and [V, H] (fp32) when fused, the logits' own size when
starting from logits. On CPU, fused: 0.07x the seed's peak extra memory and about half its time
(bench/kl.py). `distillation_loss` is the seed's function; `fused_distillation_loss` starts from
hidden states; `fused_cross_entropy_loss` is SFT's cross-entropy through the same path (forward
KL to a one-hot teacher, read off as the label's log-prob), optionally weighted per token: the
sampled-token estimator (opd.loss_sampled) is that weighted cross-entropy. opd.divergences
declares each direction, the teacher signal it reads and its kernel in opd.loss_parallel.

Directions (TRL / Liger GKD conventions, p = student, q = teacher, both at `temperature`):
forward_kl = KL(q || p); reverse_kl = KL(p || q); jsd = beta * KL(q || m) + (1 - beta) *
KL(p || m), m = beta * q + (1 - beta) * p, with beta = 0 meaning forward_kl and beta = 1
reverse_kl exactly (the interior expression tends to 0 at both ends, so the ends are the KLs,
not limits); hybrid_kl = forward_kl on each target token where the teacher's top token has
probability >= forward_kl_above, reverse_kl on the others (0: forward_kl everywhere). Every
loss is multiplied by temperature ** 2, as in the seed. The teacher is always detached;
sampling is detached (the GKD semi-gradient).

Normalisation: `reduction="mean"` divides by this call's target count (the seed); with
`reduction="sum"` the trainer divides by the target count of the whole global batch (all
micro-batches, all data-parallel ranks), so every target token weighs the same:
    loss = fused_distillation_loss(..., reduction="sum") / global_target_count

Robustness: bf16 and fp16 inputs are computed in fp32 (fp64 stays fp64); -inf logits (masked
vocabulary entries) contribute exactly zero and never NaN (a divergence that is infinite in
exact arithmetic comes out huge but finite); a student and a teacher whose vocabularies differ
only by embedding padding (151,936 vs 152,064) share an explicit `vocab_size`: columns (or
lm_head rows) at and beyond it are ignored and get zero gradient.

Vocabulary parallel (`vocab_parallel_group`): each rank of the group holds an equal, contiguous
slice of the vocabulary (rank r holds [r * V_local, (r + 1) * V_local)): of both logits, or of
both lm_heads (and biases). Row max, log-sum-exp and divergence terms are all-reduced, so no rank
holds a full row. Every rank returns the full loss; each gets the gradient of its own logits or
lm_head shard, and the hidden-state gradient (a sum over shards) is all-reduced inside, so it is
complete on every rank: do not reduce it again. `vocab_size` is global.

Sparse teacher (TopKTeacher): the teacher's top-k log-probs at `temperature` and the log of its
remaining mass. The loss is then the divergence between the two distributions coarsened to
k + 1 outcomes (the k tokens and "the rest"): an approximation, a lower bound of the full
loss (data-processing inequality), exact when the rest is empty. Measured (V = 32768, Gaussian
teacher logits): forward_kl loses about the teacher's tail, -1.7% at top-64 mass 0.974, -0.07%
at 0.999, -35% at 0.52; reverse_kl and jsd lose 55-90% even at mass 0.999, because they weigh
the student's own mass in the teacher's unknown tail: use a sparse teacher with forward_kl.

ZeRO-3 (DeepSpeed) partitions the student lm_head. This function returns the gradient of the
full [V, H] weight, and DeepSpeed accumulates it into `weight.grad` (then reduce-scatters it
from its post-accumulate-grad hook) only while the parameter has its full shape: the weight must
stay gathered until the backward of this loss has run. Two ways, both checked against plain
torch on 2 gloo ranks (deepspeed 0.19.8; untied and tied embeddings; gradient accumulation) in
tests/test_loss_parallel.py:
  1. Gather explicitly, and run the backward inside:
         with deepspeed.zero.GatheredParameters([lm_head.weight], modifier_rank=None):
             loss = fused_distillation_loss(hidden, lm_head.weight, ..., reduction="sum")
             engine.backward(loss / global_target_count)
  2. Call the loss inside the forward of a module of the DeepSpeed-wrapped model, reading
     `self.<...>.lm_head.weight` there (opd.backends.DistillModule does this): ZeRO-3 gathers
     the weight for that forward and gathers it again for that module's backward.
Gathering only around the loss call and running the backward after the weight is partitioned
again fails ("The size of tensor a (0) must match the size of tensor b ...").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opd import divergences, loss_parallel

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

DIRECTIONS = divergences.names("distribution")
REDUCTIONS = ("mean", "sum")
# Rows per chunk default to about this many logits (48 MB per fp32 buffer; up to four are live,
# opd.divergences counts them), but never fewer than MIN_CHUNK_ROWS, below which the chunk
# matmuls lose speed.
CHUNK_ELEMENTS = 3 << 22
MIN_CHUNK_ROWS = 128


@dataclass(frozen=True)
class TopKTeacher:
    """A teacher distribution kept as its top-k log-probs plus the log of the remaining mass.

    `logprobs` must already be at the distillation temperature (the loss applies `temperature`
    to the student only); `token_ids` are distinct per row and global vocabulary indices.
    """

    token_ids: torch.Tensor  # [..., K] long
    logprobs: torch.Tensor  # [..., K]
    rest_logprob: torch.Tensor  # [...], log(1 - sum(exp(logprobs)))

    @classmethod
    def from_logits(cls, logits, k, temperature=1.0, vocab_size=None, chunk_rows=256):
        """The exact top-k of full teacher logits, as a teacher server would send it."""
        width = logits.shape[-1] if vocab_size is None else vocab_size
        flat = logits.reshape(-1, logits.shape[-1])
        ids, logprobs, rest = [], [], []
        for start in range(0, flat.shape[0], chunk_rows):
            chunk = flat[start:start + chunk_rows, :width]
            chunk = chunk.to(torch.promote_types(chunk.dtype, torch.float32))
            logp = torch.log_softmax(chunk / temperature, -1)
            top_logp, top_ids = logp.topk(k, dim=-1)
            rest.append(logp.scatter(1, top_ids, float("-inf")).logsumexp(-1))
            ids.append(top_ids)
            logprobs.append(top_logp)
        lead = logits.shape[:-1]
        return cls(torch.cat(ids).view(*lead, k), torch.cat(logprobs).view(*lead, k),
                   torch.cat(rest).view(lead))


@dataclass(frozen=True)
class _Teacher:
    """Where a chunk's teacher distribution comes from: exactly one field group is set."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    logits_fn: Callable | None = None
    topk: TopKTeacher | None = None


# (row losses [C], first row, end row) of a chunk of target rows (in target-mask order) ->
# (the rows' loss values [C], the weights [C] their logit gradients are multiplied by).
RowWeights = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Plan:
    rows: tuple  # index tensors into the leading (token) dims of every per-token input
    teacher: _Teacher
    labels: torch.Tensor | None  # [...] token ids: the one-hot teacher of the labels kernel
    row_weights: RowWeights | None
    width: int  # vocabulary columns used on this rank: [0, width) of its logits or lm_head rows
    offset: int  # global vocabulary index of this rank's column 0
    temperature: float
    direction: str
    beta: float
    forward_kl_above: float  # hybrid_kl's teacher confidence
    counts: dict | None  # hybrid_kl adds its forward-KL rows to counts["forward_kl_tokens"]
    scale: float  # 1 / target count for "mean", 1 for "sum"
    chunk_size: int
    group: object


def _accumulate_matmul_(acc, a, b):
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


class _ChunkedDistillation(torch.autograd.Function):
    """Loss and all student gradients in one chunked forward pass; backward only scales."""

    @staticmethod
    def forward(ctx, student, weight, bias, plan):
        # student: logits [..., V] when weight is None, else hidden [..., H] for `weight` [V, H].
        need_student, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_grad = need_student or need_weight or need_bias
        fused = weight is not None
        dtype = torch.promote_types(student.dtype, torch.float32)
        width, temperature, num_rows = plan.width, plan.temperature, plan.rows[0].numel()
        grad_scale = plan.scale * temperature  # d loss / d logits = scale * T**2 * grad / T
        loss = torch.zeros((), dtype=torch.float64, device=student.device)
        grad_student = torch.zeros_like(student) if need_student and not fused else None
        grad_hidden_RH = student.new_empty(num_rows, student.shape[-1], dtype=dtype) \
            if need_student and fused else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=dtype) if need_bias else None
        weight_used = weight[:width] if fused else None
        bias_used = None if bias is None else bias[:width]
        # Reused by every chunk: these [chunk, width] buffers are the working set.
        buffers = divergences.get(plan.direction).chunk_buffers
        workspace = [student.new_empty(min(plan.chunk_size, num_rows), width, dtype=dtype)
                     for _ in range(buffers)]
        for start in range(0, num_rows, plan.chunk_size):
            stop = min(start + plan.chunk_size, num_rows)
            rows = tuple(index[start:stop] for index in plan.rows)
            chunk_workspace = [buffer[:stop - start] for buffer in workspace]
            args = (student, weight_used, bias_used, plan, rows, chunk_workspace, need_grad)
            loss_C, grad_CV = loss_parallel.chunk_loss_and_grad(*args, careful=False) \
                or loss_parallel.chunk_loss_and_grad(*args, careful=True)
            if plan.row_weights is not None:
                loss_C, weight_C = plan.row_weights(loss_C, start, stop)
                if grad_CV is not None:
                    grad_CV.mul_(weight_C[:, None])
            loss += loss_C.sum(dtype=torch.float64)
            if not need_grad:
                continue
            if not fused:
                grad_CV = grad_CV.mul_(grad_scale).to(student.dtype)
                grad_student[rows + (slice(None, width),)] = grad_CV
                continue
            grad_low_CV = grad_CV.to(weight.dtype)
            if need_student:
                grad_hidden_RH[start:stop] = grad_low_CV @ weight_used
            if need_weight:
                _accumulate_matmul_(grad_weight[:width], grad_low_CV.t(), student[rows])
            if need_bias:
                grad_bias[:width] += grad_CV.sum(0)
        if grad_hidden_RH is not None:
            loss_parallel.all_reduce_(grad_hidden_RH, torch.distributed.ReduceOp.SUM, plan.group)
            grad_student = torch.zeros_like(student)
            grad_student[plan.rows] = grad_hidden_RH.mul_(grad_scale).to(student.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_scale).to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_scale).to(bias.dtype)
        ctx.grads = (grad_student, grad_weight, grad_bias)
        return (loss * (plan.scale * temperature ** 2)).to(dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.grads
        if grad_loss.item() != 1.0:
            grads = tuple(None if grad is None else grad * grad_loss for grad in grads)
        return (*grads, None)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | TopKTeacher,
                      target_mask: torch.Tensor, temperature: float = 1.0,
                      direction: str = "forward_kl", *, beta: float = 0.5,
                      forward_kl_above: float = 0.9, vocab_size: int | None = None, reduction: str = "mean",
                      chunk_size: int | None = None,
                      vocab_parallel_group: ProcessGroup | None = None,
                      counts: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Full-vocabulary divergence on target tokens, scaled by temperature ** 2.

    The seed's function: [batch, time, vocab] logits, a [batch, time] bool mask of target
    positions, the mean over targets (`reduction="mean"`), the same errors; an empty mask gives
    a zero that still has a graph. `teacher_logits` may also be a TopKTeacher whose leading
    dims are [batch, time]. Extra memory is O(chunk_size x vocab) plus the logits' gradient.
    `counts`, when given, receives the loss's token counts (see `fused_distillation_loss`).
    """
    if isinstance(teacher_logits, TopKTeacher):
        topk, teacher_shape = teacher_logits, tuple(teacher_logits.token_ids.shape)
    else:
        topk, teacher_shape = None, tuple(teacher_logits.shape)
    same_vocab = topk is not None or vocab_size is not None \
        or teacher_shape == tuple(student_logits.shape)
    if student_logits.ndim != 3 or teacher_shape[:-1] != tuple(student_logits.shape[:2]) \
            or len(teacher_shape) != 3 or not same_vocab:
        raise ValueError(f"Student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{teacher_shape} must share [batch, time, vocab] (pass vocab_size= "
                         f"when the vocabularies differ only by padding)")
    if tuple(target_mask.shape) != tuple(student_logits.shape[:2]):
        raise ValueError(f"Target mask {tuple(target_mask.shape)} must align with the shifted "
                         f"logits [batch, time] = {tuple(student_logits.shape[:2])}")
    direction = _check_options(temperature, direction, beta, forward_kl_above, reduction,
                               chunk_size)
    if topk is not None:
        _check_topk(topk, student_logits.shape[:2])
    width, offset = _vocab_layout(student_logits.shape[-1],
                                  None if topk else teacher_shape[-1], vocab_size,
                                  vocab_parallel_group)
    mask = _bool_mask(target_mask)
    if not mask.any():
        return student_logits[:, :0, :].sum()
    teacher = _Teacher(topk=teacher_logits) if isinstance(teacher_logits, TopKTeacher) \
        else _Teacher(logits=teacher_logits.detach())
    return _run(student_logits, None, None, mask, teacher, width, offset, float(temperature),
                direction, (beta, forward_kl_above), reduction, chunk_size, vocab_parallel_group,
                counts=counts)


def fused_distillation_loss(
        student_hidden: torch.Tensor, student_lm_head_weight: torch.Tensor,
        teacher_hidden: torch.Tensor | None = None,
        teacher_lm_head_weight: torch.Tensor | None = None,
        target_mask: torch.Tensor | None = None, *, student_bias: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
        teacher_logits_fn: Callable[[tuple], torch.Tensor] | None = None,
        teacher_topk: TopKTeacher | None = None, vocab_size: int | None = None,
        chunk_size: int | None = None, temperature: float = 1.0, direction: str = "forward_kl",
        beta: float = 0.5, forward_kl_above: float = 0.9, reduction: str = "mean",
        vocab_parallel_group: ProcessGroup | None = None,
        counts: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """`distillation_loss` formed chunk by chunk from hidden states; no [N, V] tensor exists.

    student_hidden [..., H_s] with student_lm_head_weight [V_s, H_s] (and student_bias [V_s]);
    the teacher is exactly one of: teacher_hidden [..., H_t] with teacher_lm_head_weight
    [V_t, H_t] (and teacher_bias), `teacher_logits_fn(rows)` returning the teacher logits
    [len(rows[0]), >= V] (this rank's shard when vocabulary parallel) of the token rows
    `tensor[rows]` (called without grad, once per chunk), or a TopKTeacher. target_mask [...]
    selects the target tokens (all when None). Gradients flow to student_hidden,
    student_lm_head_weight and student_bias. With `counts` (a dict) hybrid_kl adds to
    counts["forward_kl_tokens"] (a float64 scalar, created at 0) the number of target tokens
    that took forward KL, for the trainer's `forward_kl_fraction`.
    """
    lead = _check_student(student_hidden, student_lm_head_weight, student_bias)
    if (teacher_lm_head_weight is not None) + (teacher_logits_fn is not None) \
            + (teacher_topk is not None) != 1:
        raise ValueError("Give exactly one teacher: teacher_lm_head_weight (with teacher_hidden), "
                         "teacher_logits_fn or teacher_topk")
    teacher_width = None
    if teacher_lm_head_weight is not None:
        teacher_weight_shape = tuple(teacher_lm_head_weight.shape)
        if teacher_hidden is None or tuple(teacher_hidden.shape[:-1]) != lead \
                or len(teacher_weight_shape) != 2 \
                or teacher_weight_shape[1] != teacher_hidden.shape[-1]:
            hidden_shape = None if teacher_hidden is None else tuple(teacher_hidden.shape)
            raise ValueError(f"Teacher hidden {hidden_shape} and teacher lm_head weight "
                             f"{teacher_weight_shape} must be "
                             f"[{', '.join(map(str, lead))}, H_t] and [vocab, H_t]")
        _check_bias("teacher_bias", teacher_bias, teacher_weight_shape[0])
        teacher_width = teacher_weight_shape[0]
    elif teacher_hidden is not None:
        raise ValueError("teacher_hidden is used only with teacher_lm_head_weight; a "
                         "teacher_logits_fn closes over its own inputs")
    if teacher_topk is not None:
        _check_topk(teacher_topk, lead)
    mask = _token_mask(target_mask, lead, student_hidden.device)
    direction = _check_options(temperature, direction, beta, forward_kl_above, reduction,
                               chunk_size)
    width, offset = _vocab_layout(student_lm_head_weight.shape[0], teacher_width, vocab_size,
                                  vocab_parallel_group)
    teacher = _Teacher(
        hidden=None if teacher_hidden is None else teacher_hidden.detach(),
        weight=None if teacher_lm_head_weight is None else teacher_lm_head_weight.detach(),
        bias=None if teacher_bias is None else teacher_bias.detach(),
        logits_fn=teacher_logits_fn, topk=teacher_topk)
    return _run(student_hidden, student_lm_head_weight, student_bias, mask, teacher, width,
                offset, float(temperature), direction, (beta, forward_kl_above), reduction,
                chunk_size, vocab_parallel_group, counts=counts)


def fused_cross_entropy_loss(
        student_hidden: torch.Tensor, student_lm_head_weight: torch.Tensor,
        labels: torch.Tensor, target_mask: torch.Tensor | None = None, *,
        student_bias: torch.Tensor | None = None, vocab_size: int | None = None,
        chunk_size: int | None = None, temperature: float = 1.0, reduction: str = "mean",
        row_weights: RowWeights | None = None,
        vocab_parallel_group: ProcessGroup | None = None) -> torch.Tensor:
    """Cross-entropy of `labels` [...] (SFT), formed chunk by chunk from hidden states.

    The forward KL to a teacher sure of each label: exactly the label's negative log-likelihood
    (the teacher's entropy is zero), read off by the same chunked pass as
    `fused_distillation_loss`, with its memory bound and its vocabulary handling, in two
    [chunk, vocab] buffers. `row_weights` turns it into a per-token-weighted cross-entropy: it
    receives each chunk's row losses -log p(label) and returns the rows' loss values and the
    weights of their gradients (opd.loss_sampled builds the policy-gradient estimator this way).
    """
    lead = _check_student(student_hidden, student_lm_head_weight, student_bias)
    if labels.is_floating_point() or tuple(labels.shape) != lead:
        raise ValueError(f"Labels {tuple(labels.shape)} must be integer token ids, one per "
                         f"hidden state {lead}")
    mask = _token_mask(target_mask, lead, student_hidden.device)
    _check_scalars(temperature, reduction, chunk_size)
    group = vocab_parallel_group
    width, offset = _vocab_layout(student_lm_head_weight.shape[0], None, vocab_size, group)
    shards = 1 if group is None else torch.distributed.get_world_size(group)
    vocab = vocab_size or student_lm_head_weight.shape[0] * shards
    targets = labels[mask]
    if targets.numel() and not 0 <= int(targets.min()) <= int(targets.max()) < vocab:
        raise ValueError(f"Labels at target positions must be token ids in [0, {vocab}), got "
                         f"ids from {int(targets.min())} to {int(targets.max())}")
    return _run(student_hidden, student_lm_head_weight, student_bias, mask, _Teacher(), width,
                offset, float(temperature), "sft", (0.0, 0.0), reduction, chunk_size, group,
                labels=labels, row_weights=row_weights)


def _run(student, weight, bias, mask, teacher, width, offset, temperature, direction, options,
         reduction, chunk_size, group, labels=None, row_weights=None, counts=None):
    # options: the direction's (beta, forward_kl_above)
    rows = mask.nonzero(as_tuple=True)
    count = rows[0].numel()
    plan = _Plan(rows=rows, teacher=teacher, labels=labels, row_weights=row_weights,
                 width=width, offset=offset,
                 temperature=temperature, direction=direction, beta=float(options[0]),
                 forward_kl_above=float(options[1]), counts=counts,
                 scale=1.0 / count if reduction == "mean" and count else 1.0,
                 chunk_size=chunk_size or max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // width),
                 group=group)
    return _ChunkedDistillation.apply(student, weight, bias, plan)


def _check_options(temperature, direction, beta, forward_kl_above, reduction, chunk_size):
    """Validate the options; return the direction with jsd's end points resolved."""
    _check_scalars(temperature, reduction, chunk_size)
    if direction not in DIRECTIONS:
        raise ValueError(f"KL direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must lie in [0, 1], got {beta}")
    if not 0.0 <= forward_kl_above <= 1.0:
        raise ValueError(f"hybrid_kl forward_kl_above must lie in [0, 1], got {forward_kl_above}")
    if direction == "jsd" and beta in (0.0, 1.0):
        return "forward_kl" if beta == 0.0 else "reverse_kl"
    return direction


def _check_scalars(temperature, reduction, chunk_size):
    if not temperature > 0:
        raise ValueError(f"Distillation temperature must be positive, got {temperature}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size!r}")


def _check_student(hidden, weight, bias):
    """The token dims of the student's hidden states, after checking them against lm_head."""
    weight_shape = tuple(weight.shape)
    if hidden.ndim < 2 or len(weight_shape) != 2 or weight_shape[1] != hidden.shape[-1]:
        raise ValueError(f"Student hidden {tuple(hidden.shape)} and student lm_head "
                         f"weight {weight_shape} must be [..., H] and [vocab, H]")
    _check_bias("student_bias", bias, weight_shape[0])
    return tuple(hidden.shape[:-1])


def _token_mask(target_mask, lead, device):
    """The bool target mask over the token dims `lead` (all tokens when None)."""
    if target_mask is None:
        return torch.ones(lead, dtype=torch.bool, device=device)
    if tuple(target_mask.shape) != lead:
        raise ValueError(f"Target mask {tuple(target_mask.shape)} must match the hidden states' "
                         f"token dims {lead}")
    return _bool_mask(target_mask)


def _vocab_layout(student_width, teacher_width, vocab_size, group):
    """(vocabulary columns used on this rank, global index of its first column)."""
    if group is None:
        if vocab_size is None:
            if teacher_width is not None and teacher_width != student_width:
                raise ValueError(f"Student vocabulary ({student_width}) and teacher vocabulary "
                                 f"({teacher_width}) differ; pass vocab_size= the real vocabulary "
                                 f"they share when one is only padded")
            return student_width, 0
        limit = min(student_width, teacher_width or student_width)
        if not 0 < vocab_size <= limit:
            raise ValueError(f"vocab_size={vocab_size} must be between 1 and {limit}, the smaller "
                             f"of the student ({student_width}) and teacher "
                             f"({teacher_width or student_width}) vocabularies")
        return vocab_size, 0
    if teacher_width is not None and teacher_width != student_width:
        raise ValueError(f"Vocabulary shards must be equally wide for student and teacher, got "
                         f"{student_width} and {teacher_width} on this rank")
    offset = loss_parallel.shard_offset(student_width, group)
    if vocab_size is None:
        return student_width, offset
    total = student_width * torch.distributed.get_world_size(group)
    if not offset < vocab_size <= total:
        raise ValueError(f"vocab_size={vocab_size} must be between {offset + 1} and {total}: the "
                         f"vocabulary is sharded {student_width} per rank and this rank starts "
                         f"at {offset}")
    return min(student_width, vocab_size - offset), offset


def _check_bias(name, bias, width):
    if bias is not None and tuple(bias.shape) != (width,):
        raise ValueError(f"{name} {tuple(bias.shape)} must be [{width}], one per lm_head row")


def _check_topk(topk, lead):
    ids_shape = tuple(topk.token_ids.shape)
    if ids_shape[:-1] != tuple(lead) or tuple(topk.logprobs.shape) != ids_shape \
            or tuple(topk.rest_logprob.shape) != tuple(lead) or topk.token_ids.is_floating_point():
        raise ValueError(f"TopKTeacher token_ids {ids_shape}, logprobs "
                         f"{tuple(topk.logprobs.shape)} and rest_logprob "
                         f"{tuple(topk.rest_logprob.shape)} must be [*{tuple(lead)}, k] integer, "
                         f"[*{tuple(lead)}, k] and {tuple(lead)}")


def _bool_mask(target_mask):
    if target_mask.dtype == torch.uint8:
        return target_mask.bool()
    if target_mask.dtype != torch.bool:
        raise ValueError(f"Target mask must be a bool tensor, got {target_mask.dtype}")
    return target_mask
