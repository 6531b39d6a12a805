"""One conversation as the student saw and wrote it: the unit that flows from a sampler (or the
dataset, for off-policy steps) through teacher scoring and packing into the loss."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class HasStatus(Protocol):
    status: str  # "ok" | "invalid" | "failed" (opd.tools.ToolResult)


@dataclass
class ToolCallCounts:
    """Per trajectory; each call counts once: ok -> valid, else invalid or failed."""
    valid: int = 0
    invalid: int = 0
    failed: int = 0

    def add(self, results: Iterable[HasStatus]) -> None:
        for result in results:
            name = {"ok": "valid", "invalid": "invalid", "failed": "failed"}[result.status]
            setattr(self, name, getattr(self, name) + 1)


@dataclass
class AgentTrajectory:
    """One conversation as the student saw and wrote it (seed fields first)."""

    input_ids: list[int]
    assistant_mask: list[bool]
    turns: int
    tool_calls: int
    truncated: bool
    truncation_reason: str | None = None  # see opd.rollout's docstring
    # prompt | assistant | observation | user (a further user turn)
    spans: list[tuple[int, int, str]] = field(default_factory=list)
    counts: ToolCallCounts = field(default_factory=ToolCallCounts)
    logprobs: list[float] = field(default_factory=list)  # one per target token, in order
    environment_state: Any = None  # a stateful environment's final state() (None: none)
    environment_error: str | None = None  # why the environment ended the episode early
    # The calls that ran, per user turn, per assistant message: [turn][message][call], each
    # {"name", "arguments"}; a message without calls is an empty step (what BFCL scores).
    calls_by_turn: list[list[list[dict]]] = field(default_factory=lambda: [[]])
    reward: float | None = None  # the world's checker's score of the episode (on-policy)
    advantage: float = 0.0  # its group-normalised reward (opd.rewards)
    # A per-conversation teacher's scores of the target tokens (opd.teachers.base.TeacherScores)
    teacher_scores: Any = None
    # Where the observation of each turn with a refused (invalid or failed) call ends: the
    # student's tokens after the Nth were written after N refusals (loss.mask_after_refusals).
    refusal_ends: list[int] = field(default_factory=list)

    @classmethod
    def from_prompt(cls, ids: Sequence[int]) -> AgentTrajectory:
        """A conversation of its prompt alone (context), before the first assistant turn."""
        return cls(input_ids=list(ids), assistant_mask=[False] * len(ids), turns=0, tool_calls=0,
                   truncated=False, spans=[(0, len(ids), "prompt")])

    def append(self, ids: Sequence[int], kind: str) -> None:
        """Append a span of `kind`; only assistant tokens are targets."""
        start = len(self.input_ids)
        self.input_ids.extend(ids)
        self.assistant_mask.extend([kind == "assistant"] * len(ids))
        self.spans.append((start, len(self.input_ids), kind))

    def mask_after_refusals(self, count: int) -> None:
        """No target after the observation of the `count`th turn with a refused call (none: all
        stay); the sampler's log-probs of the targets kept stay aligned with them. Idempotent."""
        if count < 1 or len(self.refusal_ends) < count:
            return
        cut = self.refusal_ends[count - 1]
        kept = sum(self.assistant_mask[:cut])
        self.assistant_mask[cut:] = [False] * (len(self.input_ids) - cut)
        self.logprobs = self.logprobs[:kept]

    def assistant_spans(self) -> list[tuple[int, int]]:
        return [(start, end) for start, end, kind in self.spans if kind == "assistant"]
