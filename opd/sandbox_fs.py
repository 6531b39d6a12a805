"""The files a tool worker's calls see (opd.tool_worker): private scratch directories, and the
interpreter readable to the sandbox user.

In the worker's mount namespace (when the kernel gives it one), its zygote and call children see
- one private tmpfs of `memory_limit_mb` MiB over /tmp, with two of its directories bind-mounted
  over /var/tmp and /dev/shm: files written there (shared memory included) count against that
  one cap, and the zygote empties it after every stateless call and every episode, so nothing
  outlives them; the host's own /tmp, /var/tmp and /dev/shm are never touched;
- the interpreter and every import path (sys.prefix, sys.path) readable to the unprivileged user
  calls run as: where such a path lies under a directory that user may not enter (a Python
  installed under a 0700 /root), that directory is covered by an empty tmpfs holding only the
  import paths, bind-mounted back. A module imported lazily at call time (datetime.strptime's
  _strptime, an environment's own late imports) then loads as it would for the trainer, and
  nothing else of that directory is visible. The host's files and modes are left alone.

Without a mount namespace, the zygote imports the standard library's lazily-imported modules
before calls drop privileges (`preload_lazy_imports`), TMPDIR and HOME are the worker's own
directory (emptied after every call and episode), each file a call writes is capped at
`memory_limit_mb` (RLIMIT_FSIZE), and /tmp, /var/tmp, /dev/shm are the host's.
"""

import contextlib
import os
import shutil
import signal
import sys
from typing import Any

_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC = 2, 4, 4096, 1 << 14

# Standard-library modules the interpreter imports only when first used (datetime.strptime
# imports _strptime; a codec lookup imports its encodings module).
LAZY_STDLIB_MODULES = ("_strptime", "encodings.idna", "stringprep", "unicodedata", "locale",
                       "calendar")

# One tmpfs over /tmp; two of its directories are bind-mounted over /var/tmp and /dev/shm.
_PRIVATE_TMP = "/tmp"
_BOUND_TMP = {"/var/tmp": ".opd-var-tmp", "/dev/shm": ".opd-dev-shm"}


def preload_lazy_imports() -> None:
    import encodings
    import importlib
    import pkgutil

    codecs = [f"encodings.{m.name}" for m in pkgutil.iter_modules(encodings.__path__)]
    for module in (*LAZY_STDLIB_MODULES, *codecs):
        with contextlib.suppress(Exception):  # a codec of another platform (mbcs, oem)
            importlib.import_module(module)


def private_filesystem(libc: Any, memory_mb: int, drop: tuple | None, workdir: str) -> list[str]:
    """Set up the module docstring's mounts in a mount namespace of the zygote's own (the
    launcher keeps the host's view, to remove the worker's directory there); the isolation
    tags of what was set up ([] when nothing could be)."""
    if libc is None or libc.unshare(_CLONE_NEWNS) != 0:
        return []
    tags = []
    if drop and _expose_import_paths(libc, drop, workdir):
        tags.append("imports")
    options = f"size={memory_mb}m,mode=1777".encode()
    if libc.mount(b"tmpfs", _PRIVATE_TMP.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                  options) != 0:
        return tags
    for target, name in _BOUND_TMP.items():
        source = os.path.join(_PRIVATE_TMP, name)
        os.mkdir(source)
        os.chmod(source, 0o1777)
        if os.path.isdir(target) and \
                libc.mount(source.encode(), target.encode(), None, _MS_BIND, None) != 0:
            return tags
    reset_private_tmp(workdir, drop)
    return [*tags, "tmp"]


def _enterable(path: str, uid: int, gid: int) -> bool:
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    return bool(st.st_mode & (0o010 if st.st_gid == gid else 0o001))


def _expose_import_paths(libc: Any, drop: tuple, workdir: str) -> bool:
    """Make the interpreter, sys.path and the worker's directory reachable for the user `drop`
    names (see the module docstring); whether every one of them is."""
    uid, gid = drop[1], drop[2]
    needed: list[str] = []
    for path in sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix,
                                                       sys.exec_prefix, *sys.path, workdir)
                        if p and os.path.isdir(p)}):
        if not any(path.startswith(parent + os.sep) for parent in needed):
            needed.append(path)  # one under another comes with it
    blocked: dict[str, list[str]] = {}  # topmost directory `uid` cannot enter -> paths below
    for path in needed:
        parts = path.split(os.sep)
        ancestors = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
        top = next((a for a in ancestors if not _enterable(a, uid, gid)), None)
        if top == os.sep:
            return False
        if top is not None:
            blocked.setdefault(top, []).append(path)
    for top, paths in blocked.items():
        if any(top.startswith(other + os.sep) for other in blocked):
            continue  # covered with the outer one
        inner = [p for other, ps in blocked.items()
                 if other == top or other.startswith(top + os.sep) for p in ps]
        handles = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in inner}
        try:
            if libc.mount(b"tmpfs", top.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                          b"size=1m,mode=0755") != 0:
                return False
            for path, handle in handles.items():
                os.makedirs(path, mode=0o755, exist_ok=True)
                if libc.mount(f"/proc/self/fd/{handle}".encode(), path.encode(), None,
                              _MS_BIND | _MS_REC, None) != 0:
                    return False
        finally:
            for handle in handles.values():
                os.close(handle)
    return True


def reset_private_tmp(workdir: str, drop: tuple | None) -> None:
    """Empty the private tmpfs, then give the worker its (empty) directory back: the trainer
    made it on the host's /tmp, which the tmpfs hides."""
    with contextlib.suppress(OSError), os.scandir(_PRIVATE_TMP) as entries:
        for entry in entries:
            if entry.name in _BOUND_TMP.values():
                empty(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    if not os.path.isdir(workdir):
        os.makedirs(workdir, mode=0o700)
        if drop:
            os.chown(workdir, drop[1], drop[2])
    empty(workdir)  # a directory outside /tmp (the trainer's TMPDIR) is not in the tmpfs
    os.chdir(workdir)


def limit_file_size(memory_mb: int) -> None:
    """Writing a file past memory_mb raises OSError (EFBIG) instead of killing the writer."""
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (memory_mb * 2**20, memory_mb * 2**20))


def empty(directory: str) -> None:
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
