"""The answer checker a recipe names as `eval.checker` (opd.eval): its contract as protocols.

A checker is `check(final_text, record) -> bool` (`AnswerChecker`), or, to judge a stateful
environment's episode too, `check(final_text, record, episode) -> bool` (`EpisodeChecker`), where
`episode` is an `EpisodeOutcome`. Which of the two a checker is, is read from its signature: a
third positional parameter (or *args) makes it an episode checker. Optional attributes:
`accuracy_name` (eval reports answer accuracy under that name too) and `forgives_failed_calls`
(a rejected or failed call the episode recovered from does not fail its task).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, cast


class AnswerChecker(Protocol):
    def __call__(self, final_text: str, record: dict, /) -> bool: ...


class EpisodeChecker(Protocol):
    def __call__(self, final_text: str, record: dict, episode: EpisodeOutcome, /) -> bool: ...


Checker = AnswerChecker | EpisodeChecker


def takes_state(check: Checker) -> bool:
    """Whether `check` accepts a third positional argument (the episode's outcome)."""
    try:
        parameters = list(inspect.signature(check).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument contract
        return False
    positional = [p for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


@dataclass(frozen=True)
class EpisodeOutcome:
    """What an episode checker may judge besides the final text: `state`, the episode's final
    environment state (what the environment's `state()` returned at the end, as JSON values;
    None with stateless tools, or when the environment died, failed to start or its state()
    failed), and `calls_by_turn`, the calls the environment ran, per user turn and per
    assistant message (`AgentTrajectory.calls_by_turn`)."""

    state: Any
    calls_by_turn: list[list[list[dict]]]


def call_checker(check: Checker, text: str, record: dict, episode: EpisodeOutcome) -> bool:
    """`check(text, record, episode)` for a checker that takes it, else `check(text, record)`."""
    if takes_state(check):
        return cast(EpisodeChecker, check)(text, record, episode)
    return cast(AnswerChecker, check)(text, record)
