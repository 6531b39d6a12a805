"""The teacher seam: every signal (full distribution, top-k, sampled tokens) and both times of
scoring (per micro-batch inside the step, per conversation at collect time) give the loss the
same numbers, so a served teacher that scores conversations can replace an in-process one."""

from dataclasses import replace

import pytest
import torch
from conftest import build_tiny_model

from opd.backends import DistillModule, load_causal_lm
from opd.config import Config, LossConfig, TeacherConfig
from opd.dist import World
from opd.loss import TopKTeacher
from opd.objective import DistillationHead
from opd.packing import pack_varlen
from opd.teachers.base import (
    FullDistribution,
    SampledLogprobs,
    SignalRequest,
    open_head,
    packed_signal,
)
from opd.teachers.in_process import ReplicatedTeacher
from opd.trajectory import AgentTrajectory

ONE_CPU_RANK = World(rank=0, world_size=1, local_rank=0, local_world_size=1,
                     device=torch.device("cpu"))


@pytest.fixture(scope="module")
def models(qwen3_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    build_tiny_model(qwen3_tokenizer, root / "student")
    build_tiny_model(qwen3_tokenizer, root / "teacher", seed=1, hidden_size=48)
    return root / "student", root / "teacher", len(qwen3_tokenizer)


def trajectories(vocab: int) -> list[AgentTrajectory]:
    """Three conversations with prompt, assistant, observation and assistant spans."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for spans in ([(5, False), (7, True)], [(4, False), (3, True), (6, False), (5, True)],
                  [(9, False), (2, True)]):
        ids, mask = [], []
        for length, target in spans:
            ids += torch.randint(0, vocab, (length,), generator=generator).tolist()
            mask += [target] * length
        out.append(AgentTrajectory(ids, mask, turns=1, tool_calls=0, truncated=False))
    return out


def teacher_for(teacher_dir, scoring: str) -> ReplicatedTeacher:
    config = Config(teacher=TeacherConfig(engine="replicated", scoring=scoring))
    model = load_causal_lm(str(teacher_dir), torch.float32, "sdpa", "model.teacher")
    return ReplicatedTeacher(config, model, ONE_CPU_RANK, torch.float32)


def signals(teacher_dir, vocab: int, request: SignalRequest):
    """The micro-batch signal, scored inside the step and scored per conversation."""
    conversations = trajectories(vocab)
    (batch,) = pack_varlen(conversations, max_tokens=256)
    in_step = teacher_for(teacher_dir, "micro_batch").score_micro_batch(batch, request)
    teacher = teacher_for(teacher_dir, "conversation")
    teacher.score_conversations(conversations, request)
    at_collect = packed_signal(batch, conversations, request, teacher.head)
    return batch, in_step, at_collect


@pytest.mark.parametrize("kind", ["distribution", "topk", "sampled"])
def test_conversation_scores_equal_micro_batch_scores(models, kind):
    _, teacher_dir, vocab = models
    request = SignalRequest(kind, vocab, temperature=1.5, top_k=8)
    batch, in_step, at_collect = signals(teacher_dir, vocab, request)
    rows = batch.target_mask[0]
    assert type(in_step) is type(at_collect)
    for name in vars(in_step):
        a, b = getattr(in_step, name), getattr(at_collect, name)
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a[rows], b[rows], rtol=0, atol=1e-5)


def test_sampled_signal_is_the_teachers_log_prob_of_the_next_token(models):
    _, teacher_dir, vocab = models
    request = SignalRequest("sampled", vocab, temperature=2.0)
    batch, in_step, _ = signals(teacher_dir, vocab, request)
    assert isinstance(in_step, SampledLogprobs)
    model = load_causal_lm(str(teacher_dir), torch.float32, "sdpa", "model.teacher")
    with torch.no_grad():
        logits_NV = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                          use_cache=False).logits[0]
    expected_N = torch.log_softmax(logits_NV / 2.0, -1).gather(
        1, batch.input_ids[0].roll(-1)[:, None]).squeeze(1)
    rows = batch.target_mask[0]
    torch.testing.assert_close(in_step.logprobs_N[rows], expected_N[rows], rtol=0, atol=1e-5)
    assert in_step.logprobs_N[~rows].abs().sum() == 0  # nothing outside the targets


@pytest.mark.parametrize("direction", ["forward_kl", "reverse_kl", "jsd"])
def test_top_k_of_the_whole_vocabulary_is_the_full_distribution(models, direction):
    """k = V leaves no tail: the top-k signal's loss and gradients equal the full one's."""
    student_dir, teacher_dir, vocab = models
    loss_config = LossConfig(direction=direction, temperature=1.5)
    results = []
    for kind in ("distribution", "topk"):
        request = SignalRequest(kind, vocab, temperature=1.5, top_k=vocab)
        batch, signal, _ = signals(teacher_dir, vocab, request)
        student = load_causal_lm(str(student_dir), torch.float32, "sdpa", "model.student")
        with open_head(signal) as teacher_head:
            head = DistillationHead(signal, teacher_head, batch.target_mask[0], loss_config,
                                    vocab)
            loss_sum, _ = DistillModule(student)(input_ids=batch.input_ids,
                                                 position_ids=batch.position_ids,
                                                 head_loss=head.loss)
        grads = torch.autograd.grad(loss_sum, list(student.parameters()))
        results.append((loss_sum, grads, signal))
    (full, full_grads, full_signal), (topk, topk_grads, topk_signal) = results
    assert isinstance(full_signal, FullDistribution) and isinstance(topk_signal, TopKTeacher)
    torch.testing.assert_close(topk, full, rtol=1e-5, atol=1e-6)
    for a, b in zip(topk_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_conversation_without_scores_never_trains(models):
    _, teacher_dir, vocab = models
    request = SignalRequest("sampled", vocab)
    conversations = trajectories(vocab)
    (batch,) = pack_varlen(conversations, max_tokens=256)
    teacher = teacher_for(teacher_dir, "conversation")
    teacher.score_conversations(conversations, request)
    conversations[1] = replace(conversations[1], teacher_scores=None)
    with pytest.raises(RuntimeError, match="without its teacher scores"):
        packed_signal(batch, conversations, request, teacher.head)
