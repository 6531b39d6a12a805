"""The Teacher interface and the signals it returns.

A teacher scores the tokens the student wrote and returns one of three signals, the one the
loss's divergence needs (opd.divergences) and `teacher.signal` picks:

    distribution   the teacher's final hidden states plus its output head, opened for the
                   duration of one micro-batch's loss: the loss forms the full teacher
                   distribution chunk by chunk (opd.loss), exact and never [N, V] in memory
                   (a served teacher sends the hidden states; the trainer holds the head)
    topk           the top-k token ids and log-probs at the loss temperature plus the log of the
                   mass outside them (opd.loss.TopKTeacher): what logit-serving teachers return
    sampled        the log-prob of each sampled token only: all the sampled-token estimator
                   needs, and the cheapest payload

When it scores:

    per micro-batch      `score_micro_batch(batch, request)` inside the optimizer step, on the
                         packed tokens (in-process engines; collective for sharded ones: every
                         rank makes the same number of calls)
    per conversation     `score_conversations(trajectories, request)` at collect time, once per
                         finished conversation; the scores travel on the trajectory
                         (`AgentTrajectory.teacher_scores`, target tokens only) and packing puts
                         them in place (`packed_signal`): the shape a served teacher needs
    as each one ends     a teacher that `overlaps_rollout` takes each conversation with
                         `submit(trajectory, request)` as soon as the rollout finishes it (a
                         future; opd.teachers.overlap), while the others still run
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opd.loss import TopKTeacher
from opd.packing import PackedBatch, per_target
from opd.teachers import TEACHERS

if TYPE_CHECKING:
    from opd.config import Config
    from opd.dist import World
    from opd.trajectory import AgentTrajectory

@dataclass(frozen=True)
class SignalRequest:
    """What the loss needs from the teacher this run."""

    kind: str  # "distribution" | "topk" | "sampled" (opd.divergences.SIGNALS but "labels")
    vocab_size: int  # the vocabulary student and teacher share
    temperature: float = 1.0  # topk / sampled log-probs are at the loss temperature
    top_k: int = 0  # kind == "topk"


HeadWeights = tuple[torch.Tensor, torch.Tensor | None]  # (weight [V, H], bias [V] | None)
Head = Callable[[], AbstractContextManager[HeadWeights]]


@dataclass
class FullDistribution:
    """Final hidden states [N, H] of a micro-batch and the head that turns them into logits."""

    hidden_NH: torch.Tensor
    head: Head  # opens (weight [V, H], bias [V] | None) for one micro-batch's loss


@dataclass
class SampledLogprobs:
    """logprobs_N[i]: the teacher's log-prob of token i + 1 at target position i (0 elsewhere)."""

    logprobs_N: torch.Tensor


TeacherSignal = FullDistribution | TopKTeacher | SampledLogprobs


def open_head(signal: TeacherSignal | None
              ) -> AbstractContextManager[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The context the loss and its backward run in: the head of a full distribution."""
    if isinstance(signal, FullDistribution):
        return signal.head()
    return nullcontext((None, None))


@dataclass
class TeacherScores:
    """A conversation's signal at collect time: one row per target token, in order.

    distribution: hidden_TH (the teacher's final hidden state where it predicts each target; the
    head stays with the teacher), topk: topk_ids_TK / topk_logprobs_TK / topk_rest_T, sampled:
    logprobs_T.
    """

    logprobs_T: torch.Tensor | None = None
    topk_ids_TK: torch.Tensor | None = None
    topk_logprobs_TK: torch.Tensor | None = None
    topk_rest_T: torch.Tensor | None = None
    hidden_TH: torch.Tensor | None = None


class Teacher(ABC):
    per_conversation: bool = False  # scores at collect time instead of per micro-batch
    # Its weights live in the training processes; a served teacher's do not, so `eval.teacher`
    # does not load them there for its row of the results table (opd.pipeline).
    in_trainer: bool = True
    overlaps_rollout: bool = False  # `submit` scores one conversation in the background

    @classmethod
    @abstractmethod
    def build(cls, config: Config, world: World) -> Teacher:
        """The engine for this run (collective: every rank builds its part)."""

    @classmethod  # noqa: B027 - an optional hook
    def check(cls, config: Config, world: World) -> None:
        """Refuse, from the config and files alone, what this engine cannot run."""

    def score_micro_batch(self, batch: PackedBatch, request: SignalRequest) -> TeacherSignal:
        """The signal for one packed micro-batch (teachers that score per micro-batch)."""
        raise NotImplementedError(f"{type(self).__name__} scores whole conversations")

    def score_conversations(self, trajectories: Sequence[AgentTrajectory],
                            request: SignalRequest) -> None:
        """Set `teacher_scores` on each of this rank's trajectories (per-conversation teachers;
        collective where the engine is: every rank calls it once per step)."""
        raise NotImplementedError(f"{type(self).__name__} scores packed micro-batches")

    def submit(self, trajectory: AgentTrajectory, request: SignalRequest
               ) -> Future[TeacherScores]:
        """Score one finished conversation in the background (`overlaps_rollout` teachers):
        its scores, or the one-sentence error that ends the step, from the future."""
        raise NotImplementedError(f"{type(self).__name__} does not score in the background")

    @abstractmethod
    def head(self) -> AbstractContextManager[HeadWeights]:
        """The full output head (weight [V, H], bias [V] | None) while the context is open:
        applied on the trainer's side to hidden-state scores."""

    def close(self) -> None:  # noqa: B027 - an optional hook
        """Release what the teacher holds."""


def packed_signal(batch: PackedBatch, trajectories: Sequence[AgentTrajectory],
                  request: SignalRequest, head: Head) -> TeacherSignal:
    """A micro-batch's signal from its conversations' collect-time scores (`TeacherScores`)."""
    scores = [trajectories[index].teacher_scores for index in batch.trajectory_index]
    if any(score is None for score in scores):
        raise RuntimeError("a conversation reached the loss without its teacher scores")

    def place(name: str) -> torch.Tensor:
        return per_target(batch, [getattr(score, name) for score in scores])

    if request.kind == "sampled":
        return SampledLogprobs(place("logprobs_T"))
    if request.kind == "topk":
        return TopKTeacher(place("topk_ids_TK").long(), place("topk_logprobs_TK"),
                           place("topk_rest_T"))
    return FullDistribution(place("hidden_TH"), head)


@torch.no_grad()
def signal_from_hidden(hidden_NH: torch.Tensor, weight_VH: torch.Tensor,
                       bias_V: torch.Tensor | None, labels_N: torch.Tensor,
                       rows: torch.Tensor, request: SignalRequest, chunk_rows: int = 256
                       ) -> TeacherScores:
    """Top-k or sampled-token scores of the target `rows` of a micro-batch, from the teacher's
    hidden states and head, a chunk of rows at a time (no [N, V] tensor)."""
    vocab = request.vocab_size
    weight, bias = weight_VH[:vocab], None if bias_V is None else bias_V[:vocab]
    sampled, ids, logprobs, rest = [], [], [], []
    for start in range(0, len(rows), chunk_rows):
        chunk = rows[start:start + chunk_rows]
        logits_CV = torch.nn.functional.linear(hidden_NH[chunk], weight, bias).float()
        logp_CV = torch.log_softmax(logits_CV / request.temperature, dim=-1)
        if request.kind == "sampled":
            sampled.append(logp_CV.gather(1, labels_N[chunk, None]).squeeze(1))
            continue
        top = TopKTeacher.from_logits(logp_CV, request.top_k)  # log-probs are their own logits
        ids.append(top.token_ids)
        logprobs.append(top.logprobs)
        rest.append(top.rest_logprob)
    if request.kind == "sampled":
        return TeacherScores(logprobs_T=torch.cat(sampled) if sampled else torch.zeros(0))
    if not ids:
        return TeacherScores(topk_ids_TK=torch.zeros(0, request.top_k, dtype=torch.long),
                             topk_logprobs_TK=torch.zeros(0, request.top_k),
                             topk_rest_T=torch.zeros(0))
    return TeacherScores(topk_ids_TK=torch.cat(ids), topk_logprobs_TK=torch.cat(logprobs),
                         topk_rest_T=torch.cat(rest))


def teacher_class(engine: str) -> type[Teacher]:
    """The Teacher registered as `teacher.engine: <engine>` (the config checked the name)."""
    module, _, name = TEACHERS[engine].partition(":")
    return getattr(importlib.import_module(module), name)
