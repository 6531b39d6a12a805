"""Checkpoint integrity: a manifest of sha256 sums, damaged checkpoints passed over on resume,
rotation that keeps the newest intact checkpoint (single process; the protocol is collective)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opd import checkpoint
from opd.checkpoint import CheckpointError
from opd.dist import World

WORLD = World(0, 1, 0, 1, None)


class FakeEngine:
    """Stands in for a student engine: these tests are about the directory protocol."""

    def __init__(self, value: str = ""):
        self.value = value

    def save(self, directory: Path) -> None:
        (directory / "engine.txt").write_text(self.value * 100)

    def load(self, directory: Path) -> None:
        self.value = (directory / "engine.txt").read_text()[:2]


def _saved(root: Path, steps=(2, 4), keep: int = 3) -> None:
    for step in steps:
        checkpoint.save(root, step, FakeEngine(f"s{step}"), {}, WORLD, keep=keep)
    checkpoint._verified.clear()  # as a new process that resumes


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated": (lambda d: (d / "engine.txt").write_bytes((d / "engine.txt").read_bytes()[:7]),
                  "engine.txt has 7 bytes, 200 expected"),
    "empty": (lambda d: (d / "engine.txt").write_bytes(b""), "engine.txt has 0 bytes"),
    "bit-flipped": (lambda d: _flip(d / "engine.txt"), "engine.txt fails its sha256 check"),
    "missing file": (lambda d: (d / "rng-rank0.pt").unlink(), "rng-rank0.pt is missing"),
    "no manifest": (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_resumed(tmp_path, capsys,
                                                                               damage):
    root = tmp_path / "checkpoints"
    _saved(root)
    spoil, reason = DAMAGES[damage]
    spoil(root / "step-00000004")
    path = checkpoint.latest(root)
    assert path == root / "step-00000002"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err and "step-00000004 is damaged" in err
    engine = FakeEngine()
    assert checkpoint.load(path, engine, WORLD)["step"] == 2 and engine.value == "s2"
    assert capsys.readouterr().err == f"Resumed step 2 from {path}.\n"


def test_no_intact_checkpoint_is_one_sentence(tmp_path):
    root = tmp_path / "checkpoints"
    _saved(root)
    for step in (2, 4):
        _flip(root / f"step-{step:08d}" / "engine.txt")
    with pytest.raises(CheckpointError, match=r"No checkpoint in .* is intact \(step-00000004: "
                       r"engine.txt fails its sha256 check; step-00000002: .*logging.run_dir"):
        checkpoint.latest(root)
    assert checkpoint.latest(tmp_path / "none") is None  # nothing saved yet: start fresh


def test_an_explicit_damaged_checkpoint_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    _saved(root, steps=(2,))
    _flip(root / "step-00000002" / "engine.txt")
    with pytest.raises(CheckpointError, match="step-00000002 is damaged"):
        checkpoint.load(root / "step-00000002", FakeEngine(), WORLD)


def test_rotation_never_deletes_the_newest_intact_checkpoint(tmp_path, monkeypatch, capsys):
    root = tmp_path / "checkpoints"
    _saved(root, steps=(2,), keep=1)
    write_manifest = checkpoint._write_manifest

    def then_damaged(directory, world):  # the disk loses data after the manifest is written
        write_manifest(directory, world)
        _flip(directory / "engine.txt")

    monkeypatch.setattr(checkpoint, "_write_manifest", then_damaged)
    checkpoint.save(root, 4, FakeEngine("s4"), {}, WORLD, keep=1)
    assert "step-00000004 failed verification after writing" in capsys.readouterr().err
    assert [s for s, _ in checkpoint.checkpoints(root)] == [2, 4]  # step 2 survives keep=1
    monkeypatch.setattr(checkpoint, "_write_manifest", write_manifest)
    checkpoint.save(root, 6, FakeEngine("s6"), {}, WORLD, keep=1)
    assert [s for s, _ in checkpoint.checkpoints(root)] == [6]  # an intact newer one: rotate
