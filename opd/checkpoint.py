"""Atomic training checkpoints.

A checkpoint is written into `checkpoints/.tmp-step-<N>/` by every rank (engine shards, each
rank's RNG state, rank 0's trainer state) and only then renamed to `checkpoints/step-<N>/` by
rank 0. A rename within one directory is atomic, so a crash or a kill at any point leaves either
the previous checkpoints or the new one complete, never a half-written `step-*` that resume
would pick up. Leftover `.tmp-*` directories are ignored and cleared by the next save.

The last file written into the staging directory is `manifest.json`: size and sha256 of every
other file. A checkpoint is verified (read back and hashed, the files shared out over the ranks)
right after its rename and again before it is resumed, so that a checkpoint damaged later
(truncated by a full quota, a bad disk, a partial copy) is reported in one line and the previous
intact one is resumed instead; rotation (`checkpoint.keep`) never deletes the newest intact
checkpoint while the ones it keeps fail verification.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from opd.dist import all_gather_objects, barrier
from opd.errors import CheckpointError

STEP_DIR = re.compile(r"^step-(\d{8})$")
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"

_verified: set[Path] = set()  # checkpoints this process has verified (hashing is not free)



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


def _say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def _my_share(names: list[str]) -> list[str]:
    """This rank's slice of `names`: the ranks hash a checkpoint's files together."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank()::dist.get_world_size()]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        while block := data.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(directory: Path, world) -> None:
    """Collective: size and sha256 of every file in `directory`, written last by rank 0."""
    names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    mine = {name: [(directory / name).stat().st_size, _sha256(directory / name)]
            for name in _my_share(names)}
    files = {k: v for part in all_gather_objects(mine) for k, v in part.items()}
    if world.is_main:
        staged = directory / f".{MANIFEST}"
        staged.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")
        staged.rename(directory / MANIFEST)


def _file_problem(path: Path, name: str, size: int, sha256: str) -> str | None:
    file = path / name
    if not file.is_file():
        return f"{name} is missing"
    if file.stat().st_size != size:
        return f"{name} has {file.stat().st_size} bytes, {size} expected"
    if _sha256(file) != sha256:
        return f"{name} fails its sha256 check"
    return None


def verify(path: Path) -> str | None:
    """Collective when distributed: what is wrong with checkpoint `path`, or None when intact."""
    if path in _verified:
        return None
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        problem = None
    except FileNotFoundError:
        files, problem = {}, f"{MANIFEST} is missing"
    except (ValueError, KeyError, TypeError):
        files, problem = {}, f"{MANIFEST} is damaged"
    for name in _my_share(sorted(files)):
        if problem is None:
            problem = _file_problem(path, name, *files[name])
    problem = next((p for p in all_gather_objects(problem) if p), None)
    if problem is None:
        _verified.add(path)
    return problem


def latest(root: Path) -> Path | None:
    """The newest intact checkpoint under `root`, None when there is none at all; collective when
    distributed. A damaged one is reported in one line and passed over; `CheckpointError` when
    checkpoints exist but none is intact (resuming none would silently start over)."""
    damaged = []
    for _, path in reversed(checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        _say(f"Checkpoint {path} is damaged ({problem}); trying the one before it.")
        damaged.append(f"{path.name}: {problem}")
    if damaged:
        raise CheckpointError(f"No checkpoint in {root} is intact ({'; '.join(damaged)}); move them "
                              "away to start over, or set logging.run_dir to a new directory.")
    return None


def _rotate(root: Path, keep: int, world) -> None:
    """Collective: delete all but the newest `keep` checkpoints, yet never the newest intact one
    while none of those kept verifies."""
    found = [path for _, path in checkpoints(root)]
    kept, old = found[-keep:], found[:-keep]
    if not any(verify(path) is None for path in reversed(kept)):
        intact = next((path for path in reversed(old) if verify(path) is None), None)
        old = [path for path in old if path != intact]
    for path in old:
        if world.is_main:
            shutil.rmtree(path)
        _verified.discard(path)


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
    try:
        student.save(staging)
        torch.save(_rng_state(), staging / f"rng-rank{world.rank}.pt")
        if world.is_main:
            state = dict(trainer_state, step=step, world_size=world.world_size)
            (staging / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        problem = None
    except (OSError, RuntimeError, CheckpointException) as error:
        # A full disk or quota: torch says "unexpected pos" or "file write failed", not why.
        problem = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    problem = next((p for p in all_gather_objects(problem) if p), None)
    if problem is not None:
        _failed_write(root, staging, problem, world)
    _write_manifest(staging, world)
    barrier()
    if world.is_main:
        if final.exists():  # the same step saved again after a resume from an older one
            shutil.rmtree(final)
        staging.rename(final)
    _verified.discard(final)
    barrier()
    problem = verify(final)  # read back: a full quota or a failing disk can truncate silently
    if problem:
        _say(f"Checkpoint {final} failed verification after writing ({problem}); older "
             "checkpoints are kept.")
    _rotate(root, keep, world)
    barrier()
    return final


def _failed_write(root: Path, staging: Path, problem: str, world) -> None:
    """Collective: clear the partial `staging` (its space too) and stop in one sentence that
    names the free space and the checkpoint kept."""
    if world.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    free_gib = shutil.disk_usage(root).free / 2**30
    kept = checkpoints(root)
    barrier()
    raise CheckpointError(
        f"Writing checkpoint {staging} failed ({problem}); the filesystem of {root} has "
        f"{free_gib:.2f} GiB free (a full disk or quota?). Free space and resume: "
        + (f"checkpoint {kept[-1][1]} is kept." if kept else "no earlier checkpoint exists."))


def load(path: Path, student, world) -> dict:
    """Collective: restore engine state and this rank's RNG; returns the trainer state."""
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {TRAINER_STATE}).")
    problem = verify(path)
    if problem:
        raise CheckpointError(f"Checkpoint {path} is damaged ({problem}).")
    state = json.loads(state_file.read_text())
    if state["world_size"] != world.world_size:
        raise CheckpointError(f"Checkpoint {path} was written by {state['world_size']} ranks; resume "
                         f"it with the same world size (this run has {world.world_size}).")
    student.load(path)
    _set_rng_state(torch.load(path / f"rng-rank{world.rank}.pt", weights_only=False))
    _say(f"Resumed step {state['step']} from {path}.")
    return state
