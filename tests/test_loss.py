"""opd.loss against naive references (tests/reference_loss.py): values, gradients, errors."""

import math

import pytest
import reference_loss
import torch

from opd.loss import (
    TopKTeacher,
    distillation_loss,
    fused_cross_entropy_loss,
    fused_distillation_loss,
)

DIRECTIONS = ["forward_kl", "reverse_kl"]


def _random_case(seed, dtype=torch.float32, batch=None, time=None, vocab=None):
    gen = torch.Generator().manual_seed(seed)
    batch = batch or int(torch.randint(1, 4, (), generator=gen))
    time = time or int(torch.randint(1, 12, (), generator=gen))
    vocab = vocab or int(torch.randint(2, 90, (), generator=gen))
    student = (torch.randn(batch, time, vocab, generator=gen) * 2).to(dtype)
    teacher = (torch.randn(batch, time, vocab, generator=gen) * 3).to(dtype)
    mask = torch.rand(batch, time, generator=gen) < 0.6
    mask.view(-1)[0] = True
    return student.requires_grad_(), teacher, mask


def _value_and_grad(loss_fn, student, *args, **kwargs):
    student = student.detach().requires_grad_()
    loss = loss_fn(student, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, student)
    return loss.detach(), grad


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("seed", range(6))
def test_matches_seed_fp32(direction, seed):
    student, teacher, mask = _random_case(seed)
    temperature = [0.5, 1.0, 2.3][seed % 3]
    expected, expected_grad = _value_and_grad(reference_loss.distillation_loss, student, teacher,
                                              mask, temperature, direction)
    loss, grad = _value_and_grad(distillation_loss, student, teacher, mask, temperature,
                                 direction, chunk_size=1 + seed % 4)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_matches_seed_bf16(direction):
    student, teacher, mask = _random_case(11, torch.bfloat16, batch=2, time=9, vocab=300)
    expected, expected_grad = _value_and_grad(reference_loss.distillation_loss, student, teacher,
                                              mask, 1.5, direction)
    loss, grad = _value_and_grad(distillation_loss, student, teacher, mask, 1.5, direction,
                                 chunk_size=4)
    assert loss.dtype == expected.dtype == torch.float32  # accumulated in fp32, as the seed
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-2, atol=1e-4)


def test_empty_mask_is_zero_with_graph():
    student, teacher, mask = _random_case(3)
    loss = distillation_loss(student, teacher, torch.zeros_like(mask))
    expected = reference_loss.distillation_loss(student, teacher, torch.zeros_like(mask))
    assert loss.item() == expected.item() == 0.0 and loss.dtype == expected.dtype
    loss.backward()
    assert student.grad is not None and not student.grad.any()
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(7, 4, requires_grad=True)
    fused = fused_distillation_loss(hidden, weight, torch.randn(5, 3), torch.randn(7, 3),
                                    torch.zeros(5, dtype=torch.bool))
    fused.backward()
    assert fused.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()


@pytest.mark.parametrize("bad, message", [
    (dict(teacher=torch.zeros(2, 5, 7)), "must share \\[batch, time, vocab\\]"),
    (dict(student=torch.zeros(10, 7), teacher=torch.zeros(10, 7)), "must share"),
    (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "Target mask \\(2, 4\\) must align"),
    (dict(temperature=0.0), "temperature must be positive, got 0.0"),
    (dict(direction="kl"), "direction must be one of forward_kl, reverse_kl, jsd, hybrid_kl, got 'kl'"),
])
def test_seed_errors(bad, message):
    args = dict(student=torch.zeros(2, 5, 6), teacher=torch.zeros(2, 5, 6),
                mask=torch.ones(2, 5, dtype=torch.bool), temperature=1.0, direction="forward_kl")
    args.update(bad)
    call = (args["student"], args["teacher"], args["mask"], args["temperature"], args["direction"])
    with pytest.raises(ValueError):
        reference_loss.distillation_loss(*call)
    with pytest.raises(ValueError, match=message):
        distillation_loss(*call)


def test_option_errors():
    student, teacher, mask = _random_case(0)
    with pytest.raises(ValueError, match="beta must lie in \\[0, 1\\], got 1.5"):
        distillation_loss(student, teacher, mask, direction="jsd", beta=1.5)
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, got 'none'"):
        distillation_loss(student, teacher, mask, reduction="none")
    with pytest.raises(ValueError, match="chunk_size must be a positive number of rows, got 0"):
        distillation_loss(student, teacher, mask, chunk_size=0)
    with pytest.raises(ValueError, match="Target mask must be a bool tensor, got torch.int64"):
        distillation_loss(student, teacher, mask.long())


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_jsd_matches_reference(beta):
    student, teacher, mask = _random_case(5, torch.float64)
    expected, expected_grad = _value_and_grad(reference_loss.generalized_jsd, student, teacher,
                                              mask, 1.7, beta)
    loss, grad = _value_and_grad(distillation_loss, student, teacher, mask, 1.7, "jsd",
                                 beta=beta, chunk_size=3)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_jsd_end_points_are_the_kls():
    student, teacher, mask = _random_case(6)
    assert distillation_loss(student, teacher, mask, direction="jsd", beta=0.0).item() == \
        distillation_loss(student, teacher, mask, direction="forward_kl").item()
    assert distillation_loss(student, teacher, mask, direction="jsd", beta=1.0).item() == \
        distillation_loss(student, teacher, mask, direction="reverse_kl").item()


def test_hybrid_kl_is_forward_kl_where_the_teacher_is_sure_and_reverse_kl_elsewhere():
    student, teacher, mask = _random_case(5, torch.float64, batch=3, time=10, vocab=12)
    top_q = torch.softmax(teacher[mask] / 1.3, -1).amax(-1)
    above = top_q.median().item()  # about half the target rows on each side
    assert (top_q >= above).any() and (top_q < above).any()
    for forward_kl_above in (0.0, above, 1.0):
        expected, expected_grad = _value_and_grad(reference_loss.hybrid_kl, student, teacher,
                                                  mask, 1.3, forward_kl_above)
        loss, grad = _value_and_grad(distillation_loss, student, teacher, mask, 1.3,
                                     "hybrid_kl", forward_kl_above=forward_kl_above,
                                     chunk_size=3)
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    for forward_kl_above, direction in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        end = distillation_loss(student, teacher, mask, 1.3, "hybrid_kl",
                                forward_kl_above=forward_kl_above)
        torch.testing.assert_close(end, distillation_loss(student, teacher, mask, 1.3,
                                                          direction), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="forward_kl_above must lie in \\[0, 1\\], got 1.5"):
        distillation_loss(student, teacher, mask, direction="hybrid_kl", forward_kl_above=1.5)


def test_hybrid_kl_counts_the_target_tokens_it_puts_on_forward_kl():
    student, teacher, mask = _random_case(7, torch.float64, batch=3, time=10, vocab=12)
    top_q = torch.softmax(teacher[mask], -1).amax(-1)
    above = top_q.median().item()
    counts: dict = {}
    distillation_loss(student, teacher, mask, direction="hybrid_kl", forward_kl_above=above,
                      chunk_size=4, counts=counts)
    assert counts["forward_kl_tokens"].item() == (top_q >= above).sum().item()
    # the fused path over several chunks, and the other directions count nothing
    gen = torch.Generator().manual_seed(8)
    hidden, weight, teacher_hidden, teacher_weight = (
        torch.randn(*shape, generator=gen, dtype=torch.float64)
        for shape in ((3, 10, 6), (12, 6), (3, 10, 5), (12, 5)))
    top_q = torch.softmax(teacher_hidden[mask] @ teacher_weight.t(), -1).amax(-1)
    above = top_q.median().item()
    fused_counts: dict = {}
    fused_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, mask,
                            direction="hybrid_kl", forward_kl_above=above, chunk_size=3,
                            counts=fused_counts)
    assert fused_counts["forward_kl_tokens"].item() == (top_q >= above).sum().item()
    other: dict = {}
    fused_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, mask,
                            direction="reverse_kl", counts=other)
    assert other == {}


@pytest.mark.parametrize("direction, beta, teaches", [
    ("forward_kl", 0.5, True), ("reverse_kl", 0.5, False), ("jsd", 0.5, False),
    ("jsd", 0.1, False), ("hybrid_kl", 0.5, True)])
def test_only_forward_kl_teaches_an_action_the_student_never_takes(direction, beta, teaches):
    # The checked world's recovery (bench/recovery_token.py): the teacher is sure of a token the
    # warm student gives ~1e-17. Forward KL's gradient on that logit is q - p, about -p; every
    # other divergence's is proportional to the student's own probability (zero-forcing), so
    # on-policy reverse KL or JSD cannot raise it, whatever the teacher says. hybrid_kl is
    # forward KL on such a token (the teacher is sure of it).
    student = torch.zeros(1, 1, 8, dtype=torch.float64)
    student[0, 0, 0] = -40.0
    teacher = torch.full((1, 1, 8), -30.0, dtype=torch.float64)
    teacher[0, 0, 0] = 0.0
    mask = torch.ones(1, 1, dtype=torch.bool)
    _, grad = _value_and_grad(distillation_loss, student, teacher, mask,
                              direction=direction, beta=beta)
    if teaches:
        assert grad[0, 0, 0].item() < -0.99
    else:
        assert abs(grad[0, 0, 0].item()) < 1e-15


@pytest.mark.parametrize("direction, options", [
    ("forward_kl", {}), ("reverse_kl", {}), ("jsd", dict(beta=0.3)),
    ("hybrid_kl", dict(forward_kl_above=0.45))])
def test_gradcheck_float64(direction, options):
    student, teacher, mask = _random_case(7, torch.float64, batch=2, time=3, vocab=5)
    assert torch.autograd.gradcheck(
        lambda s: distillation_loss(s, teacher, mask, 1.3, direction, chunk_size=2, **options),
        (student,))
    gen = torch.Generator().manual_seed(8)
    hidden, weight, bias = (torch.randn(*shape, generator=gen, dtype=torch.float64,
                                        requires_grad=True) for shape in [(6, 3), (5, 3), (5,)])
    teacher_hidden = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    teacher_weight = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_distillation_loss(
            h, w, teacher_hidden, teacher_weight, mask.view(-1), student_bias=b, temperature=0.8,
            direction=direction, chunk_size=2, **options),
        (hidden, weight, bias))


def _fused_case(seed, dtype=torch.float32, student_vocab=61, teacher_vocab=61):
    gen = torch.Generator().manual_seed(seed)
    tokens = 23
    hidden = torch.randn(tokens, 8, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(student_vocab, 8, generator=gen) / 2).to(dtype).requires_grad_()
    bias = torch.randn(student_vocab, generator=gen).to(dtype).requires_grad_()
    teacher_hidden = torch.randn(tokens, 12, generator=gen).to(dtype)
    teacher_weight = (torch.randn(teacher_vocab, 12, generator=gen) / 2).to(dtype)
    mask = torch.rand(tokens, generator=gen) < 0.7
    return hidden, weight, bias, teacher_hidden, teacher_weight, mask


def _naive_fused(hidden, weight, bias, teacher_hidden, teacher_weight, mask, vocab, temperature,
                 direction):
    student_logits = (hidden @ weight[:vocab].t() + bias[:vocab])[None]
    teacher_logits = (teacher_hidden @ teacher_weight[:vocab].t())[None]
    return reference_loss.distillation_loss(student_logits, teacher_logits, mask[None],
                                            temperature, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("student_vocab, vocab_size", [(61, None), (67, 61)])
def test_fused_matches_naive(direction, student_vocab, vocab_size):
    hidden, weight, bias, teacher_hidden, teacher_weight, mask = _fused_case(
        1, student_vocab=student_vocab)
    inputs = (hidden, weight, bias)
    expected = _naive_fused(hidden, weight, bias, teacher_hidden, teacher_weight, mask, 61, 1.7,
                            direction)
    expected_grads = torch.autograd.grad(expected, inputs)
    loss = fused_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, mask,
                                   student_bias=bias, vocab_size=vocab_size, chunk_size=5,
                                   temperature=1.7, direction=direction)
    grads = torch.autograd.grad(loss, inputs)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
    assert not grads[1][61:].any() and not grads[2][61:].any()  # padded rows: no gradient


def test_fused_bf16_matches_naive():
    hidden, weight, bias, teacher_hidden, teacher_weight, mask = _fused_case(2, torch.bfloat16)
    inputs = (hidden, weight, bias)
    expected = _naive_fused(*inputs, teacher_hidden, teacher_weight, mask, 61, 1.7, "forward_kl")
    expected_grads = torch.autograd.grad(expected, inputs)
    loss = fused_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, mask,
                                   student_bias=bias, chunk_size=4, temperature=1.7)
    grads = torch.autograd.grad(loss, inputs)
    assert loss.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=2e-2, atol=2e-3)


def test_fused_teacher_logits_fn_and_its_errors():
    hidden, weight, bias, teacher_hidden, teacher_weight, mask = _fused_case(3)
    calls = []

    def teacher_logits_fn(rows):
        calls.append(rows[0].numel())
        return teacher_hidden[rows] @ teacher_weight.t()

    expected = fused_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, mask)
    loss = fused_distillation_loss(hidden, weight, target_mask=mask, chunk_size=6,
                                   teacher_logits_fn=teacher_logits_fn)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert sum(calls) == mask.sum() and max(calls) <= 6  # target rows only, chunk by chunk
    with pytest.raises(ValueError, match="teacher_logits_fn returned shape \\(6, 60\\)"):
        fused_distillation_loss(hidden, weight, target_mask=mask, chunk_size=6,
                                teacher_logits_fn=lambda rows: torch.zeros(6, 60))
    with pytest.raises(ValueError, match="Give exactly one teacher"):
        fused_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, mask,
                                teacher_logits_fn=teacher_logits_fn)
    with pytest.raises(ValueError, match="teacher_hidden is used only with"):
        fused_distillation_loss(hidden, weight, teacher_hidden, None, mask,
                                teacher_logits_fn=teacher_logits_fn)
    with pytest.raises(ValueError, match="Student hidden \\(23, 8\\) and student lm_head weight "
                                         "\\(61, 9\\) must be"):
        fused_distillation_loss(hidden, torch.zeros(61, 9), teacher_hidden, teacher_weight, mask)


def test_vocab_size_for_padded_embeddings():
    student, teacher, mask = _random_case(4, vocab=70)
    padded = torch.cat([student.detach(), torch.randn(*student.shape[:2], 8)], -1)
    with pytest.raises(ValueError, match="Student logits .* must share"):
        distillation_loss(padded, teacher, mask)
    with pytest.raises(ValueError, match="vocab_size=75 must be between 1 and 70"):
        distillation_loss(padded, teacher, mask, vocab_size=75)
    hidden, weight, _, teacher_hidden, teacher_weight, fused_mask = _fused_case(0, student_vocab=64)
    with pytest.raises(ValueError, match="Student vocabulary \\(64\\) and teacher vocabulary "
                                         "\\(61\\) differ; pass vocab_size="):
        fused_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, fused_mask)
    expected, expected_grad = _value_and_grad(reference_loss.distillation_loss, student, teacher,
                                              mask, 2.0, "reverse_kl")
    loss, grad = _value_and_grad(distillation_loss, padded, teacher, mask, 2.0, "reverse_kl",
                                 vocab_size=70)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad[..., :70], expected_grad, rtol=1e-5, atol=1e-7)
    assert not grad[..., 70:].any()


@pytest.mark.parametrize("direction, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5),
                                             ("jsd", 0.4), ("hybrid_kl", 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_vocabulary_gives_no_nan(direction, beta, dtype):
    """-inf logits (a masked vocabulary) act exactly as if those entries were not there."""
    student, teacher, mask = _random_case(9, dtype, batch=2, time=6, vocab=40)
    masked = torch.zeros(40, dtype=torch.bool)
    masked[[0, 7, 8, 39]] = True
    student_masked = student.detach().masked_fill(masked, -math.inf)
    teacher_masked = teacher.masked_fill(masked, -math.inf)
    expected, expected_grad = _value_and_grad(
        distillation_loss, student[..., ~masked], teacher[..., ~masked], mask, 1.2, direction,
        beta=beta)
    loss, grad = _value_and_grad(distillation_loss, student_masked, teacher_masked, mask, 1.2,
                                 direction, beta=beta, chunk_size=3)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad[..., ~masked], expected_grad, rtol=1e-5, atol=1e-6)
    assert not grad[..., masked].any() and not grad.isnan().any()


def test_sum_reduction_and_global_normalisation():
    """Micro-batch sums divided by the global target count equal one loss over everything."""
    student, teacher, mask = _random_case(10, batch=3, time=8, vocab=33)
    expected, expected_grad = _value_and_grad(reference_loss.distillation_loss, student, teacher,
                                              mask, 1.5, "forward_kl")
    total = int(mask.sum())
    leaf = student.detach().requires_grad_()
    for part in (slice(0, 1), slice(1, 3)):  # uneven micro-batches
        loss_sum = distillation_loss(leaf[part], teacher[part], mask[part], 1.5, reduction="sum")
        (loss_sum / total).backward()
    mean_of_means = sum(distillation_loss(student[p], teacher[p], mask[p], 1.5).item()
                        for p in (slice(0, 1), slice(1, 3))) / 2
    torch.testing.assert_close(leaf.grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert abs(mean_of_means - expected.item()) > 1e-3  # what the sum form is for


def test_backward_scales_and_repeats():
    student, teacher, mask = _random_case(12)
    loss = distillation_loss(student, teacher, mask, direction="reverse_kl")
    (once,) = torch.autograd.grad(loss, student, retain_graph=True)
    (thrice,) = torch.autograd.grad(loss * 3, student, retain_graph=True)
    (again,) = torch.autograd.grad(loss, student)
    torch.testing.assert_close(thrice, 3 * once)
    torch.testing.assert_close(again, once)


def test_no_grad_inputs_give_the_value_only():
    student, teacher, mask = _random_case(13)
    loss = distillation_loss(student.detach(), teacher, mask, 2.0)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, reference_loss.distillation_loss(student, teacher, mask, 2.0))


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_topk_teacher_is_the_coarsened_divergence(direction):
    """Top-k + rest equals the divergence over k + 1 outcomes: a lower bound, exact at k = V."""
    student, teacher, mask = _random_case(14, torch.float64, batch=2, time=7, vocab=50)
    full = distillation_loss(student, teacher, mask, 1.3, direction).item()
    errors = []
    for k in (1, 5, 20, 49):
        expected, expected_grad = _value_and_grad(reference_loss.coarse_topk_divergence, student,
                                                  teacher, mask, k, 1.3, direction)
        topk = TopKTeacher.from_logits(teacher, k, temperature=1.3)
        loss, grad = _value_and_grad(distillation_loss, student, topk, mask, 1.3, direction,
                                     chunk_size=4)
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
        errors.append(full - loss.item())
    assert all(error >= -1e-12 for error in errors)  # never above the full divergence
    assert errors == sorted(errors, reverse=True)  # a larger k is never worse
    assert abs(errors[-1]) < 1e-10  # k = V - 1: the rest is one token, nothing is lost
    assert errors[0] > 0.1 * full  # k = 1 on a flat teacher: a real approximation


def test_topk_error_on_a_peaked_teacher():
    """The approximation error is the teacher's tail: small when the top-k holds most mass."""
    student, teacher, mask = _random_case(15, batch=2, time=16, vocab=2000)
    teacher = teacher * 3  # logits with std 9: a peaked teacher, like an LM's
    full = distillation_loss(student, teacher, mask).item()
    for k, bound in [(8, 0.1), (64, 0.01)]:
        topk = TopKTeacher.from_logits(teacher, k)
        relative_error = (full - distillation_loss(student, topk, mask).item()) / full
        assert 0 <= relative_error < bound, (k, relative_error)


def test_fused_topk_teacher_matches_logits_topk():
    hidden, weight, bias, teacher_hidden, teacher_weight, mask = _fused_case(16)
    topk = TopKTeacher.from_logits(teacher_hidden @ teacher_weight.t(), 10)
    expected = distillation_loss((hidden @ weight.t())[None], TopKTeacher(
        topk.token_ids[None], topk.logprobs[None], topk.rest_logprob[None]), mask[None])
    loss = fused_distillation_loss(hidden, weight, target_mask=mask, teacher_topk=topk,
                                   chunk_size=5)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


def test_shifted_logits_slice_and_token_dims():
    """Non-contiguous logits (the usual logits[:, :-1]) and [batch, time, H] hidden states."""
    student, teacher, mask = _random_case(17, batch=2, time=9, vocab=31)
    expected, expected_grad = _value_and_grad(
        lambda s: reference_loss.distillation_loss(s[:, :-1], teacher[:, :-1], mask[:, :-1]),
        student)
    loss, grad = _value_and_grad(
        lambda s: distillation_loss(s[:, :-1], teacher[:, :-1], mask[:, :-1], chunk_size=3),
        student)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    hidden, weight, _, teacher_hidden, teacher_weight, flat_mask = _fused_case(18)
    hidden_BTH = hidden.detach()[:22].view(2, 11, 8).requires_grad_()
    loss = fused_distillation_loss(hidden_BTH, weight, teacher_hidden[:22].view(2, 11, 12),
                                   teacher_weight, flat_mask[:22].view(2, 11), chunk_size=4)
    expected = fused_distillation_loss(hidden[:22], weight, teacher_hidden[:22], teacher_weight,
                                       flat_mask[:22], chunk_size=4)
    (grad,) = torch.autograd.grad(loss, hidden_BTH)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad.view(22, 8), expected_grad[:22])


def test_topk_teacher_shape_error():
    student, teacher, mask = _random_case(19, batch=2, time=5, vocab=20)
    topk = TopKTeacher.from_logits(teacher, 4)
    bad = TopKTeacher(topk.token_ids, topk.logprobs[..., :3], topk.rest_logprob)
    with pytest.raises(ValueError, match="TopKTeacher token_ids \\(2, 5, 4\\), logprobs "
                                         "\\(2, 5, 3\\) and rest_logprob \\(2, 5\\) must be"):
        distillation_loss(student, bad, mask)


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_fused_cross_entropy_matches_the_naive_reference(temperature):
    """SFT's loss: the labels' negative log-likelihood, gradients to hidden, lm_head and bias;
    vocabulary columns past vocab_size are ignored."""
    hidden, weight, bias, _, _, mask = _fused_case(18, torch.float64)
    labels = torch.randint(0, 50, mask.shape, generator=torch.Generator().manual_seed(18))

    def naive(hidden, weight, bias):
        logits = hidden @ weight[:50].t() + bias[:50]
        return reference_loss.cross_entropy(logits, labels, mask, temperature)

    def fused(hidden, weight, bias):
        return fused_cross_entropy_loss(hidden, weight, labels, mask, student_bias=bias,
                                        vocab_size=50, chunk_size=4, temperature=temperature)

    expected = naive(hidden, weight, bias)
    expected_grads = torch.autograd.grad(expected, (hidden, weight, bias))
    loss = fused(hidden, weight, bias)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_fused_cross_entropy_rejects_labels_of_another_shape():
    hidden, weight, _, _, _, mask = _fused_case(19)
    with pytest.raises(ValueError, match="Labels \\(22,\\) must be integer token ids, one per "
                                         "hidden state \\(23,\\)"):
        fused_cross_entropy_loss(hidden, weight, torch.zeros(22, dtype=torch.long), mask)
