"""The served teacher (teacher.engine=served): a real vLLM teacher server on 127.0.0.1 scores
conversations as the in-process teacher does, refuses another vocabulary, and a teacher that
hangs or dies ends the step in one sentence instead of hanging it.

The tests marked `vllm` need the vllm extra in its own venv, as tests/test_vllm.py does:
`bash .ci/vllm.sh`, then `.venv-vllm/bin/python -m pytest -m vllm tests/test_served_teacher.py`.
The wire format and the refusals before any engine run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, build_tokenizer, free_port
from test_teachers import ONE_CPU_RANK, teacher_for, trajectories

from opd.config import Config, LossConfig, ModelConfig, RolloutConfig, TeacherConfig
from opd.errors import ConfigError, TeacherServerError, VocabularyError
from opd.teachers.base import SignalRequest
from opd.teachers.served import ServedTeacher, wait_for_health
from opd.teachers.wire import (
    ScoreAnswer,
    ScoreRequest,
    WireError,
    decode_answer,
    decode_request,
    encode_answer,
    encode_request,
)

REPO = Path(__file__).resolve().parents[1]
vllm_installed = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (bash .ci/vllm.sh; .venv-vllm/bin/python -m pytest -m vllm)")


def served_config(url: str, student: Path, teacher: Path, **teacher_keys) -> Config:
    return Config(model=ModelConfig(student=str(student), teacher=str(teacher)),
                  rollout=RolloutConfig(max_total_len=256),
                  teacher=TeacherConfig(engine="served", urls=[url], **teacher_keys))


def test_requests_and_answers_survive_the_wire_exactly():
    rng = np.random.default_rng(0)
    request = ScoreRequest("topk", 3, [np.arange(9, dtype=np.int32), np.arange(4, dtype=np.int32)],
                           [np.array([0, 4, 7], dtype=np.int32), np.array([2], dtype=np.int32)])
    back = decode_request(encode_request(request))
    assert (back.kind, back.top_k) == ("topk", 3)
    for a, b in zip(back.token_ids + back.positions, request.token_ids + request.positions):
        np.testing.assert_array_equal(a, b)
    answer = ScoreAnswer("topk", 3, rng.standard_normal(4).astype(np.float32),
                         rng.integers(0, 99, (4, 3)).astype(np.int32),
                         rng.standard_normal((4, 3)).astype(np.float32),
                         np.array([-1.0, -np.inf, -2.0, -3.0], dtype=np.float32))
    body = encode_answer(answer)
    assert len(body) == 16 + 4 * (8 * 3 + 8)  # header, then 8k + 8 bytes per target token
    back_answer = decode_answer(body)
    for name in ("logprobs_T", "topk_ids_TK", "topk_logprobs_TK", "topk_rest_T"):
        np.testing.assert_array_equal(getattr(back_answer, name), getattr(answer, name))
    with pytest.raises(WireError, match="ends before its arrays"):
        decode_answer(body[:-4])  # a partial payload is never read as a shorter one
    with pytest.raises(WireError, match="target position outside"):
        decode_request(encode_request(replace(request, positions=[np.array([8], np.int32),
                                                                  np.array([], np.int32)])))


@pytest.mark.parametrize("keys, message", [
    ({"urls": []}, "teacher.urls must list the teacher servers"),
    ({"urls": ["127.0.0.1:8800"]}, "is not an http:// URL"),
])
def test_what_a_served_teacher_cannot_run_is_refused_before_any_engine(keys, message):
    config = Config(teacher=TeacherConfig(engine="served", urls=["http://127.0.0.1:1"],
                                          signal="topk"), loss=LossConfig(direction="forward_kl"))
    config = replace(config, teacher=replace(config.teacher, **keys))
    with pytest.raises(ConfigError, match=message):
        ServedTeacher.check(config, ONE_CPU_RANK)


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0"], "--temperature must be positive, got 0"),
    (["--temperature", "1.5", "--payload", "hidden"],
     "--temperature applies to --payload logprobs; with hidden states the trainer applies the "
     "head at loss.temperature itself"),
])
def test_a_server_temperature_that_cannot_work_is_refused_in_one_sentence(argv, message, capsys):
    from opd.teachers.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model", "m", *argv])
    assert message in capsys.readouterr().err


def test_a_server_that_never_comes_up_is_reported_in_one_sentence():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TeacherServerError, match=rf"teacher.urls: {url} did not answer GET "
                                                 r"/health .* \(connection refused\)") as error:
        wait_for_health(url, timeout_s=0.5)
    assert "\n" not in str(error.value)


# -- the real engine -----------------------------------------------------------------------------

def start_server(model: Path, port: int, max_top_k: int, log: Path,
                 payload: str = "logprobs", dtype: str = "float32",
                 temperature: float = 1.0) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "opd.teachers.server", "--model", str(model), "--port", str(port),
         "--max-top-k", str(max_top_k), "--max-model-len", "512", "--dtype", dtype,
         "--gpu-memory-utilization", "0.3", "--payload", payload,
         "--temperature", f"{temperature:g}"],
        cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


@pytest.fixture(scope="module")
def models(compact_tokenizer, tmp_path_factory):
    """A student and a teacher vLLM's CPU attention serves (head size 32)."""
    root = tmp_path_factory.mktemp("served")
    build_tiny_model(compact_tokenizer, root / "student")
    build_tiny_model(compact_tokenizer, root / "teacher", seed=1, hidden_size=128)
    return root / "student", root / "teacher", len(compact_tokenizer)


def _serving(models, tmp_path_factory, temperature: float):
    _, teacher, vocab = models
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    process = start_server(teacher, port, vocab, log, temperature=temperature)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, timeout_s=600)
        yield url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    yield from _serving(models, tmp_path_factory, 1.0)


@pytest.fixture(scope="module")
def hot_server(models, tmp_path_factory):
    """The same teacher served at temperature 1.5."""
    yield from _serving(models, tmp_path_factory, 1.5)


@pytest.mark.vllm
@vllm_installed
@pytest.mark.parametrize("kind, top_k, temperature", [
    ("sampled", 0, 1.0), ("topk", None, 1.0), ("topk", 8, 1.0),
    ("sampled", 0, 1.5), ("topk", None, 1.5), ("topk", 8, 1.5)])
def test_served_scores_equal_the_in_process_teachers(models, server, hot_server, kind, top_k,
                                                     temperature):
    """Sampled log-probs, and top-k with k = V (the whole distribution) or k = 8, to 1e-4, at
    temperature 1 and, from a server started with --temperature 1.5, at 1.5."""
    student, teacher_dir, vocab = models
    request = SignalRequest(kind, vocab, temperature, top_k=vocab if top_k is None else top_k)
    config = served_config(hot_server if temperature != 1.0 else server, student, teacher_dir,
                           signal=kind)
    served = ServedTeacher.build(replace(config, loss=LossConfig(temperature=temperature)),
                                 ONE_CPU_RANK)
    remote, local = trajectories(vocab), trajectories(vocab)
    served.score_conversations(remote, request)
    teacher_for(teacher_dir, "conversation").score_conversations(local, request)
    served.close()
    for got, expected in zip(remote, local):
        if kind == "sampled":
            torch.testing.assert_close(got.teacher_scores.logprobs_T,
                                       expected.teacher_scores.logprobs_T, rtol=0, atol=1e-4)
            continue
        # Compared as distributions: equal log-probs may come in another order.
        dense = []
        for scores in (got.teacher_scores, expected.teacher_scores):
            rows = torch.full((len(scores.topk_ids_TK), vocab), -math.inf)
            dense.append(rows.scatter(1, scores.topk_ids_TK, scores.topk_logprobs_TK))
        torch.testing.assert_close(dense[0], dense[1], rtol=0, atol=1e-4)
        rest = got.teacher_scores.topk_rest_T, expected.teacher_scores.topk_rest_T
        if top_k is None:
            assert torch.isneginf(rest[0]).all() and torch.isneginf(rest[1]).all()
        else:
            torch.testing.assert_close(rest[0], rest[1], rtol=0, atol=1e-4)


def _stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/stats") as response:
        return json.loads(response.read())


@pytest.mark.vllm
@vllm_installed
@pytest.mark.parametrize("kind", ["sampled", "topk"])
def test_a_shared_prompt_is_read_from_the_prefix_cache_and_scores_stay_exact(models, server,
                                                                             kind):
    """Three samples of one long prompt, sent one by one as the rollout finishes them: the
    later ones read the prompt from vLLM's prefix cache. A repeated conversation whose cache hit
    covers its targets is scored again without the cache. Both equal the in-process teacher's
    scores to 1e-4."""
    from opd.trajectory import AgentTrajectory

    student, teacher_dir, vocab = models
    # Tokens of this case only: the module's server keeps its cache across cases.
    generator = torch.Generator().manual_seed(1 if kind == "sampled" else 2)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def conversation(ids: list[int], prompt: int) -> AgentTrajectory:
        return AgentTrajectory(list(ids), [False] * prompt + [True] * (len(ids) - prompt),
                               turns=1, tool_calls=0, truncated=False)

    prompt, early = tokens(300), tokens(300)
    remote = [conversation(prompt + tokens(40), 300) for _ in range(3)]
    remote += [conversation(early, 4), conversation(early, 4)]  # targets from position 3 on
    local = [conversation(t.input_ids, len(t.input_ids) - sum(t.assistant_mask))
             for t in remote]
    request = SignalRequest(kind, vocab, top_k=8 if kind == "topk" else 0)
    served = ServedTeacher.build(served_config(server, student, teacher_dir, signal=kind),
                                 ONE_CPU_RANK)
    before = _stats(server)
    for trajectory in remote:
        served.score_conversations([trajectory], request)
    after = _stats(server)
    served.close()
    scored = after["tokens_scored"] - before["tokens_scored"]
    assert scored == sum(len(t.input_ids) for t in remote)
    assert after["tokens_computed"] - before["tokens_computed"] < scored
    assert after["conversations_rescored"] - before["conversations_rescored"] == 1
    teacher_for(teacher_dir, "conversation").score_conversations(local, request)
    names = ("logprobs_T",) if kind == "sampled" else ("topk_logprobs_TK", "topk_rest_T")
    for got, expected in zip(remote, local):
        for name in names:
            torch.testing.assert_close(getattr(got.teacher_scores, name),
                                       getattr(expected.teacher_scores, name),
                                       rtol=0, atol=1e-4)


@pytest.mark.vllm
@vllm_installed
@pytest.mark.parametrize("mismatch, message", [
    ("tokenizer", r"serves .* with a tokenizer whose vocabulary differs from the run's"),
    ("vocab_size", r"serves a vocabulary of \d+ entries and the run compares over \d+"),
])
def test_another_vocabulary_is_refused_in_one_sentence(models, server, compact_tokenizer,
                                                       tmp_path, mismatch, message):
    if mismatch == "tokenizer":  # one token more
        tokenizer = build_tokenizer(compact_tokenizer.chat_template)
        tokenizer.add_tokens(["<extra_token>"])
        vocab_size = None
    else:  # the same tokenizer, models whose embeddings are padded
        tokenizer, vocab_size = compact_tokenizer, len(compact_tokenizer) + 64
    for name in ("student", "teacher"):
        build_tiny_model(tokenizer, tmp_path / name, vocab_size=vocab_size)
    with pytest.raises(VocabularyError, match=rf"^teacher.urls: {server} {message}") as error:
        ServedTeacher.build(served_config(server, tmp_path / "student", tmp_path / "teacher",
                                          signal="sampled"), ONE_CPU_RANK)
    assert "\n" not in str(error.value)


@pytest.mark.vllm
@vllm_installed
@pytest.mark.parametrize("kind", ["sampled", "topk"])
def test_a_server_at_another_temperature_is_refused_in_one_sentence(models, server, kind):
    student, teacher_dir, _ = models
    config = served_config(server, student, teacher_dir, signal=kind)
    with pytest.raises(ConfigError, match=rf"^teacher.urls: {server} scores at temperature 1, "
                                          r"and loss.temperature=1.5; restart it with "
                                          r"--temperature 1.5.$"):
        ServedTeacher.build(replace(config, loss=LossConfig(temperature=1.5)), ONE_CPU_RANK)


class _Proxy:
    """A proxy in front of a real server: GETs pass through, each POST goes to `answer`, which
    subclasses write to break the server's answers in one way."""

    def __init__(self, upstream: str):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                with urllib.request.urlopen(upstream + self.path) as response:
                    self.reply(response.read())

            def do_POST(self):
                proxy.answer(self, self.rfile.read(int(self.headers["Content-Length"])))

            def reply(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):
                pass

        self.upstream = upstream
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, path: str, body: bytes) -> bytes:
        with urllib.request.urlopen(urllib.request.Request(self.upstream + path,
                                                           data=body)) as response:
            return response.read()

    def answer(self, handler, body: bytes) -> None:
        raise NotImplementedError


class _ShortAnswers(_Proxy):
    """Drops the last target token of every answer (re-encoded, so the answer is well formed and
    only short): a partial payload."""

    def answer(self, handler, body: bytes) -> None:
        answer = decode_answer(self.forward(handler.path, body))
        handler.reply(encode_answer(replace(answer, logprobs_T=answer.logprobs_T[:-1])))


@pytest.mark.vllm
@vllm_installed
def test_a_partial_answer_never_trains(models, server):
    student, teacher_dir, vocab = models
    proxy = _ShortAnswers(server)
    served = ServedTeacher.build(served_config(proxy.url, student, teacher_dir, signal="sampled",
                                               retries=1), ONE_CPU_RANK)
    conversations = trajectories(vocab)
    with pytest.raises(TeacherServerError, match=r"\(an answer for \d+ target tokens, not \d+\)"):
        served.score_conversations(conversations, SignalRequest("sampled", vocab))
    assert all(t.teacher_scores is None for t in conversations)
    served.close()
    proxy.server.shutdown()


@pytest.mark.vllm
@vllm_installed
def test_a_teacher_that_hangs_or_dies_is_reported_not_waited_on(models, tmp_path):
    """A stopped server (it accepts connections and never answers) is a timeout; a killed one a
    refused connection: each ends the scoring in one sentence naming the URL, after its retries."""
    student, teacher_dir, vocab = models
    port = free_port()
    process = start_server(teacher_dir, port, 8, tmp_path / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, timeout_s=600)
        served = ServedTeacher.build(served_config(url, student, teacher_dir, signal="sampled",
                                                   timeout_s=3.0, retries=1), ONE_CPU_RANK)
        request = SignalRequest("sampled", vocab)
        conversations = trajectories(vocab)
        served.score_conversations(conversations[:1], request)  # it answers while it runs
        for send, cause in ((signal.SIGSTOP, r"no answer within teacher.timeout_s=3"),
                            (signal.SIGKILL, r"connection refused")):
            process.send_signal(send)
            with pytest.raises(TeacherServerError,
                               match=rf"^teacher.urls: {url} failed the last of 2 tries .*"
                                     rf"\({cause}\); nothing trained") as error:
                served.score_conversations(conversations, request)
            assert "\n" not in str(error.value)
            assert all(t.teacher_scores is None for t in conversations[1:])
        served.close()
    finally:
        stop(process)


def _train(recipe: Path, run_dir: Path, *overrides: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), "launch/train.py", "--recipe", str(recipe),
               f"logging.run_dir={run_dir}", "checkpoint.every=1", "eval.every=0",
               "optim.schedule=constant", "optim.warmup_steps=0", *overrides]
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as out:
        returncode = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(REPO)},
                                    timeout=600).returncode
    assert returncode == 0, f"{run_dir.name}: exit code {returncode}\n{log.read_text()[-12000:]}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def served_world(tmp_path_factory):
    """A tiny toolcalc world and its teacher behind one server started by
    launch/teacher_server.sh: (root, recipe, the trainer's overrides the script printed)."""
    from dist_scripts.world import VLLM_STUDENT_SHAPE, build_world

    root = tmp_path_factory.mktemp("served_world")
    recipe = build_world(root / "world", student_shape=VLLM_STUDENT_SHAPE,
                         teacher_shape=VLLM_STUDENT_SHAPE)
    port = free_port()
    started = subprocess.run(
        ["bash", "launch/teacher_server.sh", "--model", str(root / "world" / "teacher"),
         "--tokenizer", str(root / "world" / "tokenizer"), "--port", str(port),
         "--max-model-len", "512", "--dtype", "float32", "--gpu-memory-utilization", "0.3"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OPD_TEACHER_PYTHON": sys.executable, "VLLM_CPU_KVCACHE_SPACE": "1",
             "OPD_TEACHER_LOG": str(root / "server.log")})
    assert started.returncode == 0, started.stderr
    pid = int(re.search(r"pid (\d+)", started.stdout).group(1))
    try:
        overrides = started.stdout.strip().splitlines()[-1].split()
        assert overrides == ["teacher.engine=served", f"teacher.urls=[http://127.0.0.1:{port}]"]
        yield root, recipe, [*overrides, "loss.direction=sampled_reverse_kl"]
    finally:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.vllm
@vllm_installed
def test_zero3_on_two_ranks_trains_from_a_served_teacher_and_resumes_exactly(served_world):
    """A ZeRO-3 student on 2 ranks, its teacher behind one server: the sampled-token estimator
    trains, checkpoints every step, and a run stopped after step 2 and resumed ends like the
    uninterrupted one."""
    root, recipe, overrides = served_world
    whole = _train(recipe, root / "whole", "train.steps=3", *overrides)
    assert [r["step"] for r in whole] == [1, 2, 3]
    for record in whole:
        assert record["teacher_tokens"] > 0 and record["teacher_collect_s"] > 0
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
    assert (root / "whole" / "checkpoints").is_dir()
    _train(recipe, root / "split", "train.steps=2", *overrides)
    resumed = _train(recipe, root / "split", "train.steps=3", *overrides)
    assert [r["step"] for r in resumed][-1] == 3
    for key in ("loss", "tokens", "target_tokens", "grad_norm"):
        assert resumed[-1][key] == pytest.approx(whole[-1][key], rel=1e-5), key


@pytest.mark.vllm
@vllm_installed
@pytest.mark.parametrize("sampler", [
    [], ["rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=2"]], ids=["hf", "vllm_tp2"])
def test_scoring_that_overlaps_the_rollout_trains_like_scoring_after_it(served_world, sampler):
    """teacher.overlap sends each conversation as the rollout finishes it; the step trains the
    same as when every conversation is scored after the rollout. With one tensor-parallel vLLM
    engine shared by both ranks, the first rank samples both shares and announces the second
    rank's conversations to it as they end: each rank's scores still belong to its own."""
    root, recipe, overrides = served_world
    name = "_".join(sampler[1:]).replace("rollout.vllm_tensor_parallel_size=", "tp")
    runs = {overlap: _train(recipe, root / f"overlap_{overlap}{name}", "train.steps=2",
                            f"teacher.overlap={overlap}", *overrides, *sampler)
            for overlap in ("true", "false")}
    for during, after in zip(runs["true"], runs["false"]):
        for key in ("loss", "kl_per_token", "grad_norm", "tokens", "target_tokens",
                    "teacher_tokens"):
            assert during[key] == pytest.approx(after[key], rel=1e-5, abs=1e-7), key


class _KillsTheTeacher(_Proxy):
    """Kills the server (SIGKILL) right after passing on the first answer, then stops listening
    itself: the teacher dies mid-rollout, with the conversations that finish later still to
    score. Scoring requests go through one at a time, so a second one sent at the same moment
    (the other rank's) cannot slip through before the kill: it finds the connection closed
    without an answer."""

    def __init__(self, upstream: str, process: subprocess.Popen):
        self.process = process
        self.one_at_a_time = threading.Lock()
        self.answered = threading.Event()
        super().__init__(upstream)

    def answer(self, handler, body: bytes) -> None:
        with self.one_at_a_time:
            if self.answered.is_set():
                handler.close_connection = True
                return
            handler.reply(self.forward(handler.path, body))
            self.process.kill()
            self.answered.set()
        threading.Thread(target=self.stop_listening, daemon=True).start()

    def stop_listening(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.vllm
@vllm_installed
def test_a_teacher_killed_mid_rollout_ends_the_step_on_every_rank(served_world, tmp_path):
    """The first finished conversation is scored, then the teacher dies while the rollout goes
    on: both ranks stop with one sentence naming the URL after the retries, nothing trains."""
    root, recipe, overrides = served_world
    port = free_port()
    process = start_server(root / "world" / "teacher", port, 8, tmp_path / "server.log")
    try:
        wait_for_health(f"http://127.0.0.1:{port}", timeout_s=600)
        proxy = _KillsTheTeacher(f"http://127.0.0.1:{port}", process)
        run_dir = tmp_path / "killed"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(free_port()), "launch/train.py", "--recipe",
                   str(recipe), f"logging.run_dir={run_dir}", "train.steps=2",
                   "teacher.engine=served", f"teacher.urls=[{proxy.url}]", "teacher.retries=1",
                   "teacher.timeout_s=10", *overrides[2:]]
        finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                  timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert finished.returncode != 0
        assert re.search(rf"teacher.urls: {proxy.url} failed the last of 2 tries of a scoring "
                         r"request \((connection refused|the connection broke)", finished.stderr
                         + finished.stdout), (finished.stdout + finished.stderr)[-6000:]
        assert not (run_dir / "metrics.jsonl").exists() or \
            not (run_dir / "metrics.jsonl").read_text().strip()
        assert not (run_dir / "checkpoints").exists() or \
            not any((run_dir / "checkpoints").iterdir())
    finally:
        stop(process)
