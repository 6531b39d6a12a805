"""opd.loss_sampled: the sampled-token estimator against the naive per-token autograd version,
and, by Monte Carlo on a tiny vocabulary, against the exact full-vocabulary gradients."""

import pytest
import reference_loss
import torch

from opd.loss import fused_distillation_loss
from opd.loss_sampled import accumulate_stats, fused_sampled_kl_loss, summarize_stats

VOCAB, HIDDEN, TEACHER_HIDDEN = 7, 5, 4


def _case(seed, tokens=19, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, bias = (torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()
                            for shape in [(tokens, HIDDEN), (VOCAB, HIDDEN), (VOCAB,)])
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen)
    mask = torch.rand(tokens, generator=gen) < 0.7
    teacher = torch.randn(tokens, VOCAB, generator=gen, dtype=dtype).log_softmax(-1)
    teacher_logprobs = teacher.gather(1, labels[:, None]).squeeze(1)
    sampler_logprobs = teacher_logprobs + torch.randn(tokens, generator=gen, dtype=dtype)
    advantages = torch.randn(tokens, generator=gen, dtype=dtype) * 2
    return hidden, weight, bias, labels, mask, teacher_logprobs, sampler_logprobs, advantages


OPTIONS = [
    dict(estimator="k1"),
    dict(estimator="k3", temperature=1.7),
    dict(estimator="k1", reward_weight=0.5, distill_weight=2.0, advantage_clip=1.0),
    dict(estimator="k1", importance_cap=1.5, use_sampler=True),
    dict(estimator="k3", importance_cap=2.0, use_sampler=True, reward_weight=1.0,
         advantage_clip=0.7),
    dict(estimator="k1", distill_weight=0.0, reward_weight=1.0, use_sampler=True),
]


@pytest.mark.parametrize("options", OPTIONS)
def test_matches_the_naive_per_token_autograd_version(options):
    """Value and gradients (hidden, lm_head, bias) equal the reference to rounding."""
    options = dict(options)
    use_sampler = options.pop("use_sampler", False)
    hidden, weight, bias, labels, mask, teacher, sampler, advantages = _case(3)
    teacher = teacher if options.get("distill_weight", 1.0) else None
    sampler = sampler if use_sampler else None
    expected = reference_loss.sampled_kl_surrogate(
        hidden @ weight.t() + bias, labels, mask, teacher, sampler, advantages, **options)
    expected_grads = torch.autograd.grad(expected, (hidden, weight, bias))
    loss, stats = fused_sampled_kl_loss(hidden, weight, labels, mask, teacher,
                                        sampler_logprobs=sampler, advantages=advantages,
                                        student_bias=bias, chunk_size=3, **options)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert stats["tokens"].item() == mask.sum().item()


def test_importance_weights_are_truncated_at_the_cap():
    """w_t = min(exp(s_t - b_t), cap): the same gradient as the reward term alone with A_t * w_t,
    and the truncated count is the tokens whose ratio exceeds the cap."""
    hidden, weight, _, labels, mask, _, _, advantages = _case(4)
    with torch.no_grad():
        learner = (hidden @ weight.t()).log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    ratio = torch.linspace(0.2, 5.0, len(labels), dtype=torch.float64)
    sampler = learner - ratio.log()  # exp(s - b) = ratio
    options = dict(distill_weight=0.0, reward_weight=1.0, chunk_size=4)
    loss, stats = fused_sampled_kl_loss(hidden, weight, labels, mask, None,
                                        sampler_logprobs=sampler, advantages=advantages,
                                        importance_cap=2.0, **options)
    scaled, _ = fused_sampled_kl_loss(hidden, weight, labels, mask, None,
                                      advantages=advantages * ratio.clamp(max=2.0), **options)
    for grad, expected in zip(torch.autograd.grad(loss, (hidden, weight)),
                              torch.autograd.grad(scaled, (hidden, weight))):
        torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    assert stats["truncated_tokens"].item() == (ratio[mask] > 2.0).sum().item() > 0
    torch.testing.assert_close(stats["importance_ratio_max"], ratio[mask].max())
    torch.testing.assert_close(stats["logprob_gap_max"], ratio[mask].log().abs().max())


def test_empty_mask_is_zero_with_graph_and_zero_stats():
    hidden, weight, _, labels, mask, teacher, *_ = _case(5)
    loss, stats = fused_sampled_kl_loss(hidden, weight, labels, torch.zeros_like(mask), teacher)
    loss.backward()
    assert loss.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()
    assert all(value.item() == 0.0 for value in stats.values())


def test_statistics_sum_across_calls_and_summarize():
    hidden, weight, _, labels, mask, teacher, sampler, advantages = _case(6)
    options = dict(sampler_logprobs=sampler, advantages=advantages, reward_weight=1.0,
                   advantage_clip=2.0)
    _, whole = fused_sampled_kl_loss(hidden, weight, labels, mask, teacher, **options)
    half = torch.arange(len(labels)) < 9
    total = None
    for part in (mask & half, mask & ~half):
        _, stats = fused_sampled_kl_loss(hidden, weight, labels, part, teacher, **options)
        total = accumulate_stats(total, stats)
    for name in whole:
        torch.testing.assert_close(total[name], whole[name], msg=name)
    with torch.no_grad():
        learner = (hidden @ weight.t()).log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    summary = summarize_stats({name: value.item() for name, value in whole.items()})
    assert summary["kl_k1"] == pytest.approx((learner - teacher)[mask].mean().item())
    assert 0 < summary["clipped_fraction"] < 1 and summary["advantage_std"] > 0


@pytest.mark.parametrize("bad, message", [
    (dict(estimator="k2"), "estimator must be one of k1, k3, got 'k2'"),
    (dict(distill_weight=0.0), "must be at least 0 and not both 0"),
    (dict(reward_weight=1.0), "advantages are needed when reward_weight > 0"),
    (dict(teacher=None), "teacher_logprobs are needed exactly when distill_weight > 0"),
    (dict(teacher=torch.zeros(3)), "teacher_logprobs \\(3,\\) must be floats of the labels'"),
    (dict(importance_cap=-1.0), "must be at least 0 \\(0 turns them off\\)"),
])
def test_option_errors(bad, message):
    hidden, weight, _, labels, mask, teacher, *_ = _case(7)
    teacher = bad.pop("teacher", teacher)
    with pytest.raises(ValueError, match=message):
        fused_sampled_kl_loss(hidden, weight, labels, mask, teacher, **bad)


# Monte Carlo: a few positions, many sampled tokens each; the estimator's gradient averaged over
# BATCHES independent batches against the exact full-vocabulary gradient, in standard errors.
ROWS, SAMPLES, BATCHES, Z_LIMIT = 3, 400, 40, 5.0


def _mc_setup():
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.8
              ).requires_grad_()
    teacher_hidden = torch.randn(ROWS, TEACHER_HIDDEN, generator=gen, dtype=torch.float64)
    teacher_weight = torch.randn(VOCAB, TEACHER_HIDDEN, generator=gen, dtype=torch.float64)
    return gen, hidden, weight, teacher_hidden, teacher_weight


def _exact(direction, hidden, weight, teacher_hidden, teacher_weight, temperature):
    loss = fused_distillation_loss(hidden, weight, teacher_hidden, teacher_weight,
                                   direction=direction, reduction="sum", temperature=temperature)
    return torch.cat([grad.flatten() for grad in torch.autograd.grad(loss, (hidden, weight))])


def _monte_carlo(estimator, temperature, sampler_shift=None, importance_cap=0.0):
    """(mean, standard error) of the batch-mean gradient over BATCHES batches."""
    gen, hidden, weight, teacher_hidden, teacher_weight = _mc_setup()
    with torch.no_grad():
        student_logits = hidden @ weight.t() / temperature
        sampler_logp = (student_logits if sampler_shift is None
                        else student_logits + sampler_shift).log_softmax(-1)
        teacher_logp = (teacher_hidden @ teacher_weight.t() / temperature).log_softmax(-1)
    rows = torch.arange(ROWS).repeat_interleave(SAMPLES)
    grads = []
    for _ in range(BATCHES):
        labels = torch.multinomial(sampler_logp.exp(), SAMPLES, replacement=True,
                                   generator=gen).flatten()
        loss, _ = fused_sampled_kl_loss(
            hidden[rows], weight, labels, None, teacher_logp[rows, labels],
            sampler_logprobs=None if sampler_shift is None else sampler_logp[rows, labels],
            importance_cap=importance_cap, estimator=estimator, temperature=temperature)
        grads.append(torch.cat([grad.flatten() / SAMPLES
                                for grad in torch.autograd.grad(loss, (hidden, weight))]))
    grads = torch.stack(grads)
    return grads.mean(0), grads.std(0) / BATCHES ** 0.5


@pytest.mark.parametrize("estimator, direction, other", [("k1", "reverse_kl", "forward_kl"),
                                                          ("k3", "forward_kl", "reverse_kl")])
def test_sampled_gradient_matches_the_exact_gradient_in_expectation(estimator, direction, other):
    """k1: E[grad] = grad KL(p || q) (reverse_kl); k3 as a loss: E[grad] = grad KL(q || p)."""
    temperature = 1.3
    mean, error = _monte_carlo(estimator, temperature)
    setup = _mc_setup()[1:]
    expected = _exact(direction, *setup, temperature)
    assert ((mean - expected) / error).abs().max() < Z_LIMIT
    # The check has power: the other direction's gradient lies many standard errors away.
    assert ((mean - _exact(other, *setup, temperature)) / error).abs().max() > 4 * Z_LIMIT


def test_importance_weights_correct_a_mismatched_sampler():
    """Tokens drawn from another sampler: weighted by p / mu (a cap never reached) the k1
    gradient is again the reverse-KL gradient; unweighted (importance_cap 0), it is not."""
    shift = torch.tensor([[1.0, -0.5, 0.0, 0.3, -1.0, 0.5, 0.0]], dtype=torch.float64)
    expected = _exact("reverse_kl", *_mc_setup()[1:], 1.0)
    mean, error = _monte_carlo("k1", 1.0, sampler_shift=shift, importance_cap=1e6)
    assert ((mean - expected) / error).abs().max() < Z_LIMIT
    biased, biased_error = _monte_carlo("k1", 1.0, sampler_shift=shift, importance_cap=0.0)
    assert ((biased - expected) / biased_error).abs().max() > 2 * Z_LIMIT


def test_bf16_inputs_are_computed_in_fp32():
    hidden, weight, _, labels, mask, teacher, sampler, _ = _case(8)
    expected = reference_loss.sampled_kl_surrogate(hidden @ weight.t(), labels, mask, teacher,
                                                   sampler, importance_cap=2.0)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    low = [tensor.detach().bfloat16().requires_grad_() for tensor in (hidden, weight)]
    loss, _ = fused_sampled_kl_loss(*low, labels, mask, teacher.float(),
                                    sampler_logprobs=sampler.float(), importance_cap=2.0)
    grads = torch.autograd.grad(loss, low)
    assert loss.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), expected, rtol=2e-2, atol=2e-2)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected_grad, rtol=5e-2, atol=5e-2)


def test_labels_outside_the_vocabulary_are_refused():
    hidden, weight, _, labels, mask, teacher, *_ = _case(9)
    labels = labels.clone()
    labels[mask.nonzero()[0]] = VOCAB
    with pytest.raises(ValueError, match=f"Labels at target positions must be token ids in "
                                         f"\\[0, {VOCAB}\\), got ids from"):
        fused_sampled_kl_loss(hidden, weight, labels, mask, teacher)
