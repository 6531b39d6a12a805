"""The served teacher's hidden-state payload (teacher.signal=distribution): a real vLLM pooling
engine returns the teacher's final hidden states, the trainer applies the teacher's output head
inside the fused loss, and the loss and gradients equal the in-process teacher's; a server
without the payload, or a head from another model, is refused in one sentence.

The tests marked `vllm` run in the vLLM venv (tests/test_served_teacher.py says how); the wire
format and the refusals before any engine run everywhere.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, free_port
from test_served_teacher import (
    REPO,
    _train,
    models,
    served_config,
    server,
    start_server,
    stop,
    vllm_installed,
)
from test_teachers import ONE_CPU_RANK, teacher_for, trajectories

from opd.backends import DistillModule, load_causal_lm
from opd.config import Config, LossConfig, TeacherConfig
from opd.errors import ConfigError, VocabularyError
from opd.objective import DistillationHead
from opd.packing import pack_varlen
from opd.teachers.base import FullDistribution, SignalRequest, open_head, packed_signal
from opd.teachers.served import ServedTeacher, wait_for_health
from opd.teachers.wire import (
    ScoreAnswer,
    ScoreRequest,
    decode_answer,
    encode_answer,
    encode_request,
)

__all__ = ["models", "server"]  # module fixtures shared with test_served_teacher


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hidden_states_survive_the_wire_exactly(dtype):
    hidden_TH = torch.randn(5, 12).to(getattr(torch, dtype))
    bits = hidden_TH.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" \
        else hidden_TH.numpy()
    body = encode_answer(ScoreAnswer("distribution", 0, np.zeros(0, np.float32),
                                     hidden_TH=bits, hidden_dtype=dtype))
    # A 16-byte header, 8 bytes of hidden size and dtype, then 2H (bf16) or 4H bytes per target.
    assert len(body) == 16 + 8 + 5 * 12 * (2 if dtype == "bfloat16" else 4)
    back = decode_answer(body)
    assert (back.kind, back.targets, back.hidden_dtype) == ("distribution", 5, dtype)
    np.testing.assert_array_equal(back.hidden_TH, bits)


def test_every_signal_passes_the_config_checks_at_any_temperature():
    """The trainer applies the head to hidden states, so their temperature is its own; top-k
    and sampled log-probs come at the server's --temperature, which the trainer checks against
    its /health once it answers (tests/test_served_teacher.py), not before."""
    config = Config(teacher=TeacherConfig(engine="served", urls=["http://127.0.0.1:1"],
                                          signal="distribution"),
                    loss=LossConfig(direction="forward_kl", temperature=1.5))
    for kind in ("distribution", "topk"):
        ServedTeacher.check(replace(config, teacher=replace(config.teacher, signal=kind)),
                            ONE_CPU_RANK)


# -- the real engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hidden_server(models, tmp_path_factory):
    _, teacher, _ = models
    port = free_port()
    log = tmp_path_factory.mktemp("hidden_server") / "server.log"
    process = start_server(teacher, port, 1, log, payload="hidden")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, timeout_s=600)
        yield url
    finally:
        stop(process)


def _loss_and_grads(student_dir, batch, teacher_signal, loss_config: LossConfig, vocab: int):
    student = load_causal_lm(str(student_dir), torch.float32, "sdpa", "model.student")
    with open_head(teacher_signal) as teacher_head:
        head = DistillationHead(teacher_signal, teacher_head, batch.target_mask[0], loss_config, vocab)
        loss_sum, _ = DistillModule(student)(input_ids=batch.input_ids,
                                             position_ids=batch.position_ids,
                                             head_loss=head.loss)
    return loss_sum, torch.autograd.grad(loss_sum, list(student.parameters()))


@pytest.mark.vllm
@vllm_installed
@pytest.mark.parametrize("direction", ["forward_kl", "reverse_kl", "jsd"])
def test_hidden_payload_gives_the_in_process_loss_and_gradients(models, hidden_server,
                                                                direction):
    """The same loss and student gradients as the in-process teacher to 1e-5, at a loss
    temperature of 1.5 (applied on the trainer's side)."""
    student, teacher_dir, vocab = models
    loss_config = LossConfig(direction=direction, temperature=1.5)
    config = replace(served_config(hidden_server, student, teacher_dir, signal="distribution"),
                     loss=loss_config)
    served = ServedTeacher.build(config, ONE_CPU_RANK)
    request = SignalRequest("distribution", vocab, temperature=1.5)
    conversations = trajectories(vocab)
    (batch,) = pack_varlen(conversations, max_tokens=256)
    served.score_conversations(conversations, request)
    remote = packed_signal(batch, conversations, request, served.head)
    local = teacher_for(teacher_dir, "micro_batch").score_micro_batch(batch, request)
    served.close()
    assert isinstance(remote, FullDistribution) and isinstance(local, FullDistribution)
    remote_loss, remote_grads = _loss_and_grads(student, batch, remote, loss_config, vocab)
    local_loss, local_grads = _loss_and_grads(student, batch, local, loss_config, vocab)
    assert remote_loss > 0
    torch.testing.assert_close(remote_loss, local_loss, rtol=0, atol=1e-5)
    for got, expected in zip(remote_grads, local_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.vllm
@vllm_installed
def test_a_server_without_the_payload_is_refused_in_one_sentence(models, server, hidden_server):
    student, teacher_dir, _ = models
    for url, kind, message in (
            (server, "distribution", r"serves the sampled and topk payloads, not the "
                                     r"distribution one .*--payload hidden\.$"),
            (hidden_server, "sampled", r"serves the distribution payloads, not the sampled "
                                       r"one .*--payload logprobs\.$")):
        with pytest.raises(ConfigError, match=rf"^teacher.urls: {url} {message}") as error:
            ServedTeacher.build(served_config(url, student, teacher_dir, signal=kind),
                                ONE_CPU_RANK)
        assert "\n" not in str(error.value)


@pytest.mark.vllm
@vllm_installed
@pytest.mark.parametrize("other, message", [
    ({"seed": 2, "hidden_size": 128}, r"serves .*, whose output head differs from model.teacher="),
    ({"seed": 1, "hidden_size": 64}, r"serves hidden states of width 128 over \d+ tokens, and "
                                     r"model.teacher=.* has an output head of shape \[\d+, 64\]"),
])
def test_a_head_from_another_model_is_refused(models, hidden_server, compact_tokenizer,
                                              tmp_path, other, message):
    """model.teacher must hold the head of the model the server serves: same shape, same
    weights (a hash of the head as stored)."""
    student, _, _ = models
    build_tiny_model(compact_tokenizer, tmp_path / "teacher", **other)
    with pytest.raises(VocabularyError, match=rf"^teacher.urls: {hidden_server} {message}"):
        ServedTeacher.build(served_config(hidden_server, student, tmp_path / "teacher",
                                          signal="distribution"), ONE_CPU_RANK)


@pytest.mark.vllm
@vllm_installed
def test_zero3_on_two_ranks_trains_from_the_hidden_payload_as_from_the_in_process_teacher(
        tmp_path):
    """A recipe moved from its in-process ZeRO-Inference teacher to a hidden-payload server by
    the teacher section alone (forward KL over the full vocabulary) takes the same steps."""
    from dist_scripts.world import VLLM_STUDENT_SHAPE, build_world

    world = tmp_path / "world"
    recipe = build_world(world, student_shape=VLLM_STUDENT_SHAPE,
                         teacher_shape=VLLM_STUDENT_SHAPE)
    port = free_port()
    started = subprocess.run(
        ["bash", "launch/teacher_server.sh", "--model", str(world / "teacher"), "--tokenizer",
         str(world / "tokenizer"), "--port", str(port), "--max-model-len", "512", "--dtype",
         "float32", "--gpu-memory-utilization", "0.3", "--payload", "hidden"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OPD_TEACHER_PYTHON": sys.executable, "VLLM_CPU_KVCACHE_SPACE": "1",
             "OPD_TEACHER_LOG": str(tmp_path / "server.log")})
    assert started.returncode == 0, started.stderr
    pid = int(re.search(r"pid (\d+)", started.stdout).group(1))
    try:
        common = ("train.steps=2", "loss.direction=forward_kl")
        served = _train(recipe, tmp_path / "served", *common, "teacher.signal=distribution",
                        *started.stdout.strip().splitlines()[-1].split())
    finally:
        os.kill(pid, signal.SIGKILL)
    in_process = _train(recipe, tmp_path / "in_process", *common)
    assert [r["step"] for r in served] == [1, 2]
    for got, expected in zip(served, in_process):
        assert got["teacher_collect_s"] > 0 and "teacher_collect_s" not in expected
        for key in ("loss", "grad_norm", "target_tokens"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5), key


@pytest.mark.vllm
@vllm_installed
def test_a_bf16_engine_ships_bf16_hidden_states(models, tmp_path):
    """2H bytes per target token from a bf16 engine: its own values, so nothing is lost on the
    wire (the trainer's bf16 teacher gives the same states to bf16 rounding)."""
    student, teacher_dir, vocab = models
    port = free_port()
    process = start_server(teacher_dir, port, 1, tmp_path / "server.log", payload="hidden",
                           dtype="bfloat16")
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_for_health(url, timeout_s=600)
        conversation = trajectories(vocab)[1]
        positions = np.flatnonzero(conversation.assistant_mask[1:]).astype(np.int32)
        body = urllib.request.urlopen(urllib.request.Request(f"{url}/score", data=encode_request(
            ScoreRequest("distribution", 0, [np.array(conversation.input_ids, np.int32)],
                         [positions])))).read()
    finally:
        stop(process)
    assert len(body) == 16 + 8 + len(positions) * 2 * health.hidden_size
    answer = decode_answer(body)
    assert answer.hidden_dtype == "bfloat16"
    served = torch.from_numpy(answer.hidden_TH.copy()).view(torch.int16).view(torch.bfloat16)
    model = load_causal_lm(str(teacher_dir), torch.bfloat16, "sdpa", "model.teacher")
    with torch.no_grad():
        hidden_LH = model.model(torch.tensor([conversation.input_ids])).last_hidden_state[0]
    torch.testing.assert_close(served.float(), hidden_LH[positions].float(), rtol=0.02,
                               atol=0.05)
