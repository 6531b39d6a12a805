"""Atomic training checkpoints.

A checkpoint is written into `checkpoints/.tmp-step-<N>/` by every rank (engine shards, each
rank's RNG state, rank 0's trainer state) and only then renamed to `checkpoints/step-<N>/` by
rank 0. A rename within one directory is atomic, so a crash or a kill at any point leaves either
the previous checkpoints or the new one complete, never a half-written `step-*` that resume
would pick up. Leftover `.tmp-*` directories are ignored and cleared by the next save.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import torch

from opd.dist import barrier
from opd.errors import CheckpointError

STEP_DIR = re.compile(r"^step-(\d{8})$")
TRAINER_STATE = "trainer_state.json"



def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in root.iterdir()
             if path.is_dir() and (m := STEP_DIR.match(path.name))]
    return sorted(found)


def latest(root: Path) -> Path | None:
    found = checkpoints(root)
    return found[-1][1] if found else None


def save(root: Path, step: int, student, trainer_state: dict, world, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    final = root / f"step-{step:08d}"
    staging = root / f".tmp-step-{step:08d}"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):
            shutil.rmtree(stale)
        staging.mkdir()
    barrier()
    student.save(staging)
    torch.save(_rng_state(), staging / f"rng-rank{world.rank}.pt")
    if world.is_main:
        state = dict(trainer_state, step=step, world_size=world.world_size)
        (staging / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
    barrier()
    if world.is_main:
        if final.exists():  # the same step saved again after a resume from an older one
            shutil.rmtree(final)
        staging.rename(final)
        for _, old in checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def load(path: Path, student, world) -> dict:
    """Collective: restore engine state and this rank's RNG; returns the trainer state."""
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {TRAINER_STATE}).")
    state = json.loads(state_file.read_text())
    if state["world_size"] != world.world_size:
        raise CheckpointError(f"Checkpoint {path} was written by {state['world_size']} ranks; resume "
                         f"it with the same world size (this run has {world.world_size}).")
    student.load(path)
    _set_rng_state(torch.load(path / f"rng-rank{world.rank}.pt", weights_only=False))
    return state
