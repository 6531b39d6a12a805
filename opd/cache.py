"""A world's build-once cache: what its `prepare` step builds, built once per machine and reused.

A cached directory lives at `<cache root>/<world>/<name>` where `name` carries a key hashed from
everything that shapes its contents (parameters and the text of the code and files that build
it), so an edit rebuilds and an unchanged checkout reuses. It counts as built once its marker
file (`prepare.json`) exists. Building happens in a staging directory renamed into place under a
file lock: the ranks of a node wait for one builder, and a crash never leaves half a cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

MARKER = "prepare.json"  # written last by a builder: its presence means the directory is whole


def cache_root() -> Path:
    """`$OPD_CACHE_DIR`, default ~/.cache/opd-recipes."""
    return Path(os.environ.get("OPD_CACHE_DIR", Path.home() / ".cache" / "opd-recipes"))


def cache_key(text: str, files: Iterable[Path]) -> str:
    """16 hex digits of the hash of `text` (the parameters) and each file's name and bytes."""
    digest = hashlib.sha256(text.encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cached(out: Path, marker: str = MARKER) -> Path | None:
    """`out` when it was built (its `marker` file exists), else None; never builds."""
    return out if (out / marker).exists() else None


def build_once(out: Path, build: Callable[[Path], None], *, marker: str = MARKER,
               force: bool = False) -> Path:
    """`out`, built by `build(staging_directory)` unless already there (`force`: rebuilt).

    `build` writes everything into the directory it is given, `marker` last. One process per key
    builds at a time (a lock file next to `out`); the others wait and reuse its result. Staging
    directories a crashed builder left are removed first."""
    if not force and cached(out, marker):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force and out.exists():
            shutil.rmtree(out)
        if cached(out, marker) is None:
            shutil.rmtree(out, ignore_errors=True)  # a directory without its marker is no cache
            for stale in out.parent.glob(f"{out.name}.tmp-*"):
                shutil.rmtree(stale)
            staging = out.parent / f"{out.name}.tmp-{os.getpid()}"
            build(staging)
            staging.rename(out)
    return out
