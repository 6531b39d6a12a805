"""Scoring that overlaps the rollout: each conversation goes to the teacher as soon as it ends.

A `ScoringQueue` is the sampler's `on_finished` callback (opd.sampling.base): it hands each
finished conversation to the teacher's `submit` (a future; the request runs on the teacher's
threads) while the rollout goes on with the others, and `wait` then waits only for the answers
still outstanding. All or nothing: the scores are set on the conversations only once every one
has them, so a failed request (after the teacher's retries) leaves none half-scored and the
trainer's all-reduced failure flag stops every rank before anything trains.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opd.teachers.base import SignalRequest, Teacher, TeacherScores
    from opd.trajectory import AgentTrajectory


class ScoringQueue:
    def __init__(self, teacher: Teacher, request: SignalRequest):
        self.teacher, self.request = teacher, request
        self.futures: dict[int, Future[TeacherScores]] = {}  # by the conversation's index

    def __call__(self, index: int, trajectory: AgentTrajectory) -> None:
        """Conversation `index` is final: send it for scoring now."""
        self.futures[index] = self.teacher.submit(trajectory, self.request)

    def wait(self, trajectories: Sequence[AgentTrajectory]) -> None:
        """Set every conversation's `teacher_scores` (index i: `trajectories[i]`, which may be
        a copy of the one sent), or raise the first failure and set none."""
        try:
            missing = [i for i in range(len(trajectories)) if i not in self.futures]
            if missing:  # a sampler that did not report a conversation: a bug, not a user error
                raise RuntimeError(f"conversations {missing[:5]} were never sent for scoring")
            scores = [self.futures[i].result() for i in range(len(trajectories))]
        finally:
            self.cancel()
        for trajectory, score in zip(trajectories, scores):
            trajectory.teacher_scores = score

    def cancel(self) -> None:
        """Drop the requests not yet started (the step is failing)."""
        for future in self.futures.values():
            future.cancel()
