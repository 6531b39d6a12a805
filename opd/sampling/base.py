"""The Sampler interface and the engine-neutral turn types every engine speaks.

A sampler owns whatever it needs to sample with the student's current weights (a gathered view of
the training engine, or an inference engine holding a copy of them) and its lifecycle:

    check(config, world)   class method: refuse, from the config and files alone, what this
                           engine cannot run; called before any engine or evaluation starts
                           (`check_installed`, its first part, also in a dry run)
    sample(prompts, seed, on_finished)
                           this rank's finished trajectories (opd.trajectory.AgentTrajectory),
                           each an episode of the run's tool executor; collective where the
                           engine is (every rank calls it once per on-policy step);
                           `on_finished(index, trajectory)` hears of each as soon as it is
                           final (a served teacher scores it while the others still run)
    weights_changed()      the optimizer applied a step: the next `sample` must see new weights
    metrics()              figures of the last `sample` for metrics.jsonl (may be collective)
    close()                release the engine

The multi-turn state machine (opd.rollout) is shared: an engine either lends it a model to run
forward calls on (HF) or implements `TurnEngine` (turns in, finished turns out).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from opd.sampling import SAMPLERS

if TYPE_CHECKING:
    from opd.backends import StudentEngine
    from opd.chat import ChatFormat
    from opd.config import Config
    from opd.dist import World
    from opd.tools import ToolExecutor
    from opd.trajectory import AgentTrajectory


OnFinished = Callable[[int, "AgentTrajectory"], None]


@dataclass
class SamplerContext:
    """What every sampler is built from."""

    config: Config
    world: World
    student: StudentEngine
    chat: ChatFormat
    executor: ToolExecutor
    parser: Callable
    vocab_size: int  # the vocabulary student and teacher share: ids past it are never drawn


class Sampler(ABC):
    def __init__(self, context: SamplerContext):
        self.context = context

    @classmethod  # noqa: B027 - an optional hook
    def check_installed(cls) -> None:
        """Refuse, in one sentence, an engine whose packages are not installed (dry runs too)."""

    @classmethod
    def check(cls, config: Config, world: World) -> None:
        """Refuse what this engine cannot run, in one sentence (an OPDError); starts nothing."""
        cls.check_installed()

    @abstractmethod
    def sample(self, prompts: Sequence[dict], seed: int,
               on_finished: OnFinished | None = None) -> list[AgentTrajectory]:
        """This rank's trajectories for `prompts` (dataset records), deterministic in `seed`.

        `on_finished(index, trajectory)` is called once for each of them, on the calling
        thread, as soon as trajectory `index` will change no more (its episode closed), and
        before `sample` returns; not for the conversations of a rollout that raised."""

    def weights_changed(self) -> None:  # noqa: B027 - an optional hook
        """The student's weights changed since the last `sample`."""

    def metrics(self) -> dict:
        """Figures of the last `sample`, for metrics.jsonl."""
        return {}

    def close(self) -> None:  # noqa: B027 - an optional hook
        """Release what the sampler holds."""


@dataclass(frozen=True)
class TurnRequest:
    context: Sequence[int]  # the conversation so far (copied when submitted)
    max_tokens: int  # the turn's budget
    seed: int


@dataclass(frozen=True)
class TurnSampling:
    """How every turn of a rollout is sampled (opd.config.RolloutConfig's sampling keys)."""

    stop_token_ids: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    vocab_size: int | None = None  # the vocabulary student and teacher share


class TurnEngine(Protocol):
    """What opd.rollout asks of an engine: turns in (`submit`), finished turns out (`step`)."""

    def submit(self, request: TurnRequest, sampling: TurnSampling) -> str: ...

    @property
    def running(self) -> bool: ...

    def step(self) -> list[tuple[str, list[int], list[float]]]: ...

    def abort(self) -> None: ...


def request_seed(seed: int, conversation: int, turn: int) -> int:
    """A per-request seed from (rollout seed, conversation index, turn), within vLLM's int64."""
    return (seed * 1_000_003 + conversation * 1_009 + turn) % (2 ** 62)


def sampler_class(engine: str) -> type[Sampler]:
    """The Sampler registered as `rollout.engine: <engine>` (the config checked the name)."""
    module, _, name = SAMPLERS[engine].partition(":")
    return getattr(importlib.import_module(module), name)
