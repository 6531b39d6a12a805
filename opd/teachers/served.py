"""`teacher.engine: served`: the teacher runs in its own processes behind a real inference engine
(opd.teachers.server, vLLM), and each rank sends it its finished conversations.

The trainer's side of the wire (opd.teachers.wire): `build` waits for every replica in
`teacher.urls` to answer `GET /health` (up to `teacher.startup_timeout_s`) and refuses, in one
sentence naming the URL, a server whose tokenizer vocabulary or vocabulary size differs from the
run's, whose context is shorter than `rollout.max_total_len`, whose largest top-k is below
`teacher.top_k`, or that does not serve the payload `teacher.signal` asks for. `submit` then
sends a conversation as its own request, round-robin over the replicas with `teacher.in_flight`
requests in flight per replica: the trainer calls it as soon as the rollout finishes each
conversation (`teacher.overlap`, opd.teachers.overlap), and `score_conversations` sends a whole
list the same way.

Faults: a request that fails (refused connection, no answer within `teacher.timeout_s`, a
server error, a short or malformed answer) is retried on the next replica after a backoff, up
to `teacher.retries` times, then the step ends with one sentence (`TeacherServerError`) naming
the URL; the checkpoints written so far stay. An answer is used only if it holds exactly one
row per target token; `packed_signal` refuses a conversation without scores.

Payloads: the sampled tokens' log-probs and the top-k ids and log-probs with the rest's mass,
both at the server's `--temperature`, which must be `loss.temperature` (opd.teachers.server
scales the engine's logits by its inverse); and for
`teacher.signal=distribution` the teacher's final hidden states (a server started with
`--payload hidden`), to which the trainer applies the teacher's output head, read from
`model.teacher` alone and checked against the server's (shape and hash), inside the fused loss:
the exact full distribution at any `loss.temperature`, as the in-process teacher gives it.
"""

from __future__ import annotations

import http.client
import itertools
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from opd.config import Config
from opd.dist import World
from opd.errors import ConfigError, TeacherServerError, VocabularyError
from opd.teachers.base import HeadWeights, SignalRequest, Teacher, TeacherScores
from opd.teachers.overlap import ScoringQueue
from opd.teachers.wire import (
    Health,
    ScoreAnswer,
    ScoreRequest,
    WireError,
    decode_answer,
    encode_request,
    vocabulary_hash,
)
from opd.trajectory import AgentTrajectory

BACKOFF_S = 1.0  # before the first retry; doubled for each further one, at most 30 s


def _describe(error: BaseException, timeout_s: float) -> str:
    """A failed request's cause, in a few words."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer within teacher.timeout_s={timeout_s:g}"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, (ConnectionError, http.client.HTTPException)):
        return f"the connection broke ({type(reason).__name__})"
    return str(reason) or type(reason).__name__


class ServedTeacher(Teacher):
    per_conversation = True
    in_trainer = False
    overlaps_rollout = True
    signals = ("topk", "sampled", "distribution")

    @classmethod
    def check(cls, config: Config, world: World) -> None:
        urls = config.teacher.urls
        if not urls:
            raise ConfigError("teacher.urls must list the teacher servers (e.g. "
                              "[http://127.0.0.1:8800]) when teacher.engine=served; start one "
                              "with launch/teacher_server.sh.")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"teacher.urls: {url!r} is not an http:// URL of a teacher "
                                  "server.")

    @classmethod
    def build(cls, config: Config, world: World) -> Teacher:
        from transformers import AutoTokenizer

        from opd.inputs import check_vocabulary

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path, local_files_only=True)
        vocab_size = check_vocabulary(config.model, tokenizer)
        expected = vocabulary_hash(tokenizer)
        teacher, signal = config.teacher, config.teacher_signal
        top_k = min(teacher.top_k, vocab_size) if signal == "topk" else 0
        head = _trainer_head(config, world) if signal == "distribution" else None
        for url in teacher.urls:
            health = wait_for_health(url.rstrip("/"), teacher.startup_timeout_s)
            if signal not in health.payloads:
                raise ConfigError(
                    f"teacher.urls: {url} serves the {' and '.join(health.payloads)} payloads, "
                    f"not the {signal} one teacher.signal={teacher.signal} with "
                    f"loss.direction={config.loss.direction} needs; restart it with --payload "
                    f"{'hidden' if signal == 'distribution' else 'logprobs'}.")
            if health.tokenizer_sha256 != expected:
                raise VocabularyError(
                    f"teacher.urls: {url} serves {health.model} with a tokenizer whose "
                    f"vocabulary differs from the run's ({config.tokenizer_path}); start the "
                    "server with the run's tokenizer (--tokenizer) and a teacher that uses it.")
            if health.vocab_size != vocab_size:
                raise VocabularyError(
                    f"teacher.urls: {url} serves a vocabulary of {health.vocab_size} entries "
                    f"and the run compares over {vocab_size}; a served teacher's log-probs are "
                    "normalised over its whole vocabulary, so serve a teacher whose config has "
                    f"vocab_size={vocab_size}.")
            if health.max_model_len < config.rollout.max_total_len + 1:
                raise ConfigError(
                    f"teacher.urls: {url} scores conversations of up to "
                    f"{health.max_model_len - 1} tokens, fewer than rollout.max_total_len="
                    f"{config.rollout.max_total_len}; restart it with --max-model-len "
                    f"{config.rollout.max_total_len + 1}.")
            if signal != "distribution" and health.temperature != config.loss.temperature:
                raise ConfigError(
                    f"teacher.urls: {url} scores at temperature {health.temperature:g}, and "
                    f"loss.temperature={config.loss.temperature:g}; restart it with "
                    f"--temperature {config.loss.temperature:g}.")
            if top_k > health.max_top_k:
                raise ConfigError(
                    f"teacher.urls: {url} answers a top-k of at most {health.max_top_k}, fewer "
                    f"than teacher.top_k={top_k}; restart it with --max-top-k {top_k}.")
            if head is not None:
                _check_head(url, health, *head, config.model.teacher)
        return cls([url.rstrip("/") for url in teacher.urls], timeout_s=teacher.timeout_s,
                   retries=teacher.retries, in_flight=teacher.in_flight,
                   head=None if head is None else head[0])

    def __init__(self, urls: list[str], *, timeout_s: float, retries: int, in_flight: int,
                 head: HeadWeights | None = None):
        self.urls, self.timeout_s, self.retries = urls, timeout_s, retries
        self.head_weights = head  # the distribution payload's output head, on the trainer
        self.pool = ThreadPoolExecutor(max_workers=in_flight * len(urls),
                                       thread_name_prefix="teacher")
        self.turns = itertools.count()  # which replica the next conversation goes to first

    def submit(self, trajectory: AgentTrajectory, request: SignalRequest
               ) -> Future[TeacherScores]:
        """Score one conversation in the background: its target tokens' scores."""
        if request.kind not in self.signals:
            raise ConfigError(f"teacher.engine=served cannot return the {request.kind} signal.")
        mask = trajectory.assistant_mask
        positions = np.flatnonzero(np.asarray(mask[1:], dtype=bool)).astype(np.int32)
        body = encode_request(ScoreRequest(
            request.kind, request.top_k if request.kind == "topk" else 0,
            [np.asarray(trajectory.input_ids, dtype=np.int32)], [positions]))
        return self.pool.submit(self._score, body, request, len(positions), next(self.turns))

    def score_conversations(self, trajectories: Sequence[AgentTrajectory],
                            request: SignalRequest) -> None:
        queue = ScoringQueue(self, request)
        for index, trajectory in enumerate(trajectories):
            queue(index, trajectory)
        queue.wait(trajectories)

    def _score(self, body: bytes, request: SignalRequest, targets: int,
               turn: int) -> TeacherScores:
        """POST one request, retried on the next replica; its scores or one sentence."""
        for attempt in range(self.retries + 1):
            url = self.urls[(turn + attempt) % len(self.urls)]
            if attempt:
                time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), 30.0))
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        f"{url}/score", data=body,
                        headers={"Content-Type": "application/octet-stream"}),
                        timeout=self.timeout_s) as response:
                    answer = decode_answer(response.read())
            except urllib.error.HTTPError as error:
                message = error.read().decode(errors="replace").strip()
                if error.code == 400:  # the same request would be refused again
                    raise TeacherServerError(f"teacher.urls: {url} refused a scoring request: "
                                             f"{message}") from None
                cause = f"HTTP {error.code}: {message}"
            except (OSError, http.client.HTTPException) as error:
                cause = _describe(error, self.timeout_s)
            except WireError as error:
                cause = f"a malformed answer ({error})"
            else:
                problem = _mismatch(answer, request, targets)
                if problem is None:
                    return self._scores(answer)
                cause = problem
        raise TeacherServerError(
            f"teacher.urls: {url} failed the last of {self.retries + 1} tries of a scoring "
            f"request ({cause}); nothing trained on this step and the last checkpoint is kept: "
            "restart the teacher server, or raise teacher.timeout_s or teacher.retries.")

    @contextmanager
    def head(self):
        if self.head_weights is None:
            raise ConfigError("teacher.engine=served reads the teacher's output head only for "
                              "teacher.signal=distribution.")
        yield self.head_weights

    def _scores(self, answer: ScoreAnswer) -> TeacherScores:
        if answer.kind != "distribution":
            return _scores(answer)
        assert answer.hidden_TH is not None and self.head_weights is not None
        hidden = torch.from_numpy(answer.hidden_TH.copy())
        if answer.hidden_dtype == "bfloat16":
            hidden = hidden.view(torch.int16).view(torch.bfloat16)
        # Kept in the head's precision, as the in-process teacher's hidden states are.
        return TeacherScores(hidden_TH=hidden.to(self.head_weights[0].dtype))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _mismatch(answer: ScoreAnswer, request: SignalRequest, targets: int) -> str | None:
    """Why an answer does not fit its request (a partial payload never trains), or None."""
    if answer.kind != request.kind or (answer.kind == "topk" and answer.top_k != request.top_k):
        return f"a {answer.kind} answer with top_k={answer.top_k} to a {request.kind} request"
    if answer.targets != targets:
        return f"an answer for {answer.targets} target tokens, not {targets}"
    return None


def _trainer_head(config: Config, world: World) -> tuple[HeadWeights, str]:
    """The teacher's output head from `model.teacher`, on this rank's device in the teacher's
    precision, and the hash of the head as stored."""
    from opd.backends import resolve_precision
    from opd.teachers.output_head import head_hash, load_output_head

    weight, bias = load_output_head(config.model.teacher, "model.teacher")
    digest = head_hash(weight)
    dtype = resolve_precision(config.teacher.precision, "auto", world.device).dtype
    return (weight.to(world.device, dtype),
            None if bias is None else bias.to(world.device, dtype)), digest


def _check_head(url: str, health: Health, head: HeadWeights, digest: str, path: str) -> None:
    """Refuse a server whose hidden states this head does not belong to."""
    rows, columns = head[0].shape
    if (rows, columns) != (health.vocab_size, health.hidden_size):
        raise VocabularyError(
            f"teacher.urls: {url} serves hidden states of width {health.hidden_size} over "
            f"{health.vocab_size} tokens, and model.teacher={path} has an output head of shape "
            f"[{rows}, {columns}]; point model.teacher at the model the server serves.")
    if digest != health.head_sha256:
        raise VocabularyError(
            f"teacher.urls: {url} serves {health.model}, whose output head differs from "
            f"model.teacher={path}'s; point model.teacher at the model the server serves.")


def _scores(answer: ScoreAnswer) -> TeacherScores:
    if answer.kind == "sampled":
        return TeacherScores(logprobs_T=torch.tensor(answer.logprobs_T))
    return TeacherScores(logprobs_T=torch.tensor(answer.logprobs_T),
                         topk_ids_TK=torch.tensor(answer.topk_ids_TK).long(),
                         topk_logprobs_TK=torch.tensor(answer.topk_logprobs_TK),
                         topk_rest_T=torch.tensor(answer.topk_rest_T))


def wait_for_health(url: str, timeout_s: float) -> Health:
    """The server's `/health`, polled until it answers or `timeout_s` passes (it listens only
    once its engine is loaded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10.0) as response:
                return Health.from_json(response.read())
        except (OSError, http.client.HTTPException, ValueError) as error:
            if time.monotonic() >= deadline:
                raise TeacherServerError(
                    f"teacher.urls: {url} did not answer GET /health within "
                    f"teacher.startup_timeout_s={timeout_s:g} ({_describe(error, 10.0)}); "
                    "start it with launch/teacher_server.sh or fix the URL.") from None
        time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))
