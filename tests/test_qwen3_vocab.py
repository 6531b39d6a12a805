"""Qwen-family vocabularies padded differently (151,936 vs 152,064 rows, one tokenizer) distil
over the rows they share, through the trainer's own pieces: check_vocabulary, the student's
DistillModule root and the fused loss's `vocab_size`."""

from __future__ import annotations

import re

import pytest
import reference_loss
import torch
from conftest import build_tiny_model
from qwen3_tokenizer import QWEN3_VOCAB_SIZE

from opd.backends import DistillModule, load_causal_lm
from opd.chat import ChatFormat
from opd.config import Config, ModelConfig
from opd.dist import World
from opd.errors import VocabularyError
from opd.inputs import check_vocabulary
from opd.loss import fused_distillation_loss
from opd.packing import pack_varlen
from opd.teachers.in_process import ReplicatedTeacher
from opd.trajectory import AgentTrajectory

PADDED_VOCAB = 152064  # Qwen2.5-7B+ and some Qwen3 derivatives pad to 152,064 rows


def conversation(tokenizer, tools_text: str) -> AgentTrajectory:
    chat = ChatFormat(tokenizer, {"enable_thinking": True})
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 12 * 7? 你好 🤖"}], None)
    turn = chat.encode("<think>\nMultiply.\n</think>\n\n" + tools_text) + [tokenizer.eos_token_id]
    return AgentTrajectory(prompt + turn, [False] * len(prompt) + [True] * len(turn), 1, 0, False)


@pytest.fixture(scope="module")
def padded_pair(real_qwen3_tokenizer, tmp_path_factory):
    """Student: 151,936 rows, tied head (as Qwen3-1.7B/4B); teacher: 152,064 rows, untied."""
    root = tmp_path_factory.mktemp("padded_pair")
    build_tiny_model(real_qwen3_tokenizer, root / "student", architecture="qwen3",
                     hidden_size=64, vocab_size=QWEN3_VOCAB_SIZE, tie_word_embeddings=True)
    build_tiny_model(real_qwen3_tokenizer, root / "teacher", architecture="qwen3", seed=1,
                     hidden_size=96, vocab_size=PADDED_VOCAB)
    return root / "student", root / "teacher"


def test_padded_vocabularies_distil_over_the_shared_rows(real_qwen3_tokenizer, padded_pair):
    student_dir, teacher_dir = padded_pair
    student = load_causal_lm(str(student_dir), torch.float32, "sdpa", "model.student")
    one_cpu_rank = World(rank=0, world_size=1, local_rank=0, local_world_size=1,
                         device=torch.device("cpu"))
    teacher = ReplicatedTeacher(
        Config(), load_causal_lm(str(teacher_dir), torch.float32, "sdpa", "model.teacher"),
        one_cpu_rank, torch.float32)
    vocab = check_vocabulary(ModelConfig(student=str(student_dir), teacher=str(teacher_dir)),
                             real_qwen3_tokenizer)
    assert vocab == QWEN3_VOCAB_SIZE

    trajectories = [conversation(real_qwen3_tokenizer, "The answer is 84."),
                    conversation(real_qwen3_tokenizer, "84")]
    (batch,) = pack_varlen(trajectories, max_tokens=4096)
    mask = batch.target_mask[0]
    teacher_hidden = teacher.hidden_states(batch.input_ids, batch.position_ids)
    root = DistillModule(student)
    with teacher.head() as (teacher_weight, teacher_bias):
        def head_loss(hidden, weight, bias):
            loss = fused_distillation_loss(
                hidden, weight, teacher_hidden, teacher_weight, mask, student_bias=bias,
                teacher_bias=teacher_bias, vocab_size=vocab, chunk_size=64,
                reduction="sum")
            return loss, mask.sum()

        loss_sum, count = root(input_ids=batch.input_ids, position_ids=batch.position_ids,
                               head_loss=head_loss)
    fused = loss_sum / count
    fused_grads = torch.autograd.grad(fused, list(student.parameters()))

    # Naive: whole [T, V] logits of both models, the teacher's padding rows cut off.
    # use_cache=False: with a cache, transformers does not split packed rows at position 0.
    student_logits = student(input_ids=batch.input_ids, position_ids=batch.position_ids,
                             use_cache=False).logits
    with torch.no_grad():
        teacher_logits = teacher.hf_model(input_ids=batch.input_ids, use_cache=False,
                                          position_ids=batch.position_ids).logits
    assert student_logits.shape[-1] == vocab and teacher_logits.shape[-1] == PADDED_VOCAB
    naive = reference_loss.distillation_loss(student_logits, teacher_logits[..., :vocab],
                                             mask[None])
    naive_grads = torch.autograd.grad(naive, list(student.parameters()))
    torch.testing.assert_close(fused, naive, rtol=1e-5, atol=1e-6)
    for (name, _), got, want in zip(student.named_parameters(), fused_grads, naive_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7, msg=name)


def test_a_vocabulary_smaller_than_the_tokenizer_is_named(real_qwen3_tokenizer, padded_pair,
                                                          tmp_path):
    student_dir, _ = padded_pair
    short = build_tiny_model(real_qwen3_tokenizer, tmp_path, architecture="qwen3",
                             hidden_size=64, vocab_size=151660)  # no room for <think>
    del short
    teacher_size = re.escape(f"model.teacher: the vocabulary of {tmp_path} has 151660 entries")
    with pytest.raises(VocabularyError, match=f"{teacher_size}, fewer than the 151669 tokens"):
        check_vocabulary(ModelConfig(student=str(student_dir), teacher=str(tmp_path)),
                         real_qwen3_tokenizer)


def test_a_padded_student_never_samples_past_the_shared_vocabulary():
    """Padding rows get the largest logits here; the sampler must not draw them."""
    from opd.config import RolloutConfig
    from opd.rollout import _Sampler

    logits_BV = torch.zeros((4, 12))
    logits_BV[:, 10:] = 50.0  # padding rows 10, 11
    for top_k in (0, 1):
        sampler = _Sampler(RolloutConfig(top_k=top_k), torch.Generator().manual_seed(0),
                           vocab_size=10)
        tokens_B, logprobs_B = sampler(logits_BV)
        assert (tokens_B < 10).all()
        torch.testing.assert_close(logprobs_B, torch.full((4,), -torch.log(torch.tensor(10.0))))
