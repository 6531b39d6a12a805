"""The files a tool worker's calls see (opd.tool_worker): private scratch directories, and the
interpreter readable to the sandbox user.

In the worker's mount namespace (when the kernel gives it one), its zygote and call children see
- one private tmpfs of `memory_limit_mb` MiB over /tmp, with two of its directories bind-mounted
  over /var/tmp and /dev/shm: files written there (shared memory included) count against that
  one cap, and the zygote replaces it by a fresh one after every stateless call and every
  episode, so nothing outlives them; the host's own /tmp, /var/tmp and /dev/shm are never
  touched, except import paths under them (a clone in /tmp), which are bound back into it;
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
_MNT_DETACH = 2

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


def private_filesystem(libc: Any, memory_mb: int, drop: tuple | None, workdir: str
                       ) -> tuple[list[str], "PrivateTmp | None"]:
    """Set up the module docstring's mounts in a mount namespace of the zygote's own (the
    launcher keeps the host's view, to remove the worker's directory there): the isolation
    tags of what was set up, and the private tmpfs (None when it could not be made)."""
    if libc is None or libc.unshare(_CLONE_NEWNS) != 0:
        return [], None
    tags = []
    if drop and _expose_import_paths(libc, drop, workdir):
        tags.append("imports")
    private = PrivateTmp(libc, memory_mb, drop, workdir)
    if not private.usable or not private.fresh():
        private.detach()
        return tags, None
    return [*tags, "tmp"], private


class PrivateTmp:
    """The private tmpfs over /tmp (its directories bound over /var/tmp and /dev/shm), made
    afresh for every call and episode: the old one is detached whole, never emptied file by
    file, so an import path under /tmp, bound back into it, is never walked."""

    def __init__(self, libc: Any, memory_mb: int, drop: tuple | None, workdir: str):
        self.libc, self.drop, self.workdir = libc, drop, workdir
        self.options = f"size={memory_mb}m,mode=1777".encode()
        self.bound = [t for t in _BOUND_TMP if os.path.isdir(t) and not os.path.islink(t)]
        self.keep: dict[str, int] = {}  # where in the tmpfs -> O_PATH handle of the directory
        self.usable = True
        for path in _import_paths():
            for target in (*self.bound, _PRIVATE_TMP):
                if path == target:  # an import path that is a scratch directory itself
                    self.usable = False
                elif path.startswith(target + os.sep):
                    inside = _PRIVATE_TMP if target == _PRIVATE_TMP else \
                        os.path.join(_PRIVATE_TMP, _BOUND_TMP[target])
                    self.keep[inside + path[len(target):]] = \
                        os.open(path, os.O_PATH | os.O_DIRECTORY)
                    break

    def detach(self) -> None:
        for target in (*self.bound, _PRIVATE_TMP):
            self.libc.umount2(target.encode(), _MNT_DETACH)  # fails harmlessly when not ours

    def fresh(self) -> bool:
        """Replace the tmpfs by an empty one (import paths bound back, the worker's directory
        made again and entered); False when a mount failed."""
        libc = self.libc
        self.detach()
        if libc.mount(b"tmpfs", _PRIVATE_TMP.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                      self.options) != 0:
            return False
        umask = os.umask(0o022)  # directories above the worker's must be enterable
        try:
            for target in self.bound:
                source = os.path.join(_PRIVATE_TMP, _BOUND_TMP[target])
                os.mkdir(source)
                os.chmod(source, 0o1777)
                if libc.mount(source.encode(), target.encode(), None, _MS_BIND, None) != 0:
                    return False
            for inside, handle in self.keep.items():
                os.makedirs(inside, exist_ok=True)
                if libc.mount(f"/proc/self/fd/{handle}".encode(), inside.encode(), None,
                              _MS_BIND | _MS_REC, None) != 0:
                    return False
            if not os.path.isdir(self.workdir):
                os.makedirs(self.workdir)
                os.chmod(self.workdir, 0o700)
                if self.drop:
                    os.chown(self.workdir, self.drop[1], self.drop[2])
        finally:
            os.umask(umask)
        empty(self.workdir)  # a directory outside /tmp (the trainer's TMPDIR) is not in it
        os.chdir(self.workdir)
        return True


def _import_paths() -> list[str]:
    """The interpreter's directories and sys.path, real paths, outermost only."""
    paths: list[str] = []
    for path in sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix,
                                                       sys.exec_prefix, *sys.path)
                        if p and os.path.isdir(p)}):
        if not any(path.startswith(parent + os.sep) for parent in paths):
            paths.append(path)  # one under another comes with it
    return paths


def _enterable(path: str, uid: int, gid: int) -> bool:
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    return bool(st.st_mode & (0o010 if st.st_gid == gid else 0o001))


def _expose_import_paths(libc: Any, drop: tuple, workdir: str) -> bool:
    """Make the interpreter, sys.path and the worker's directory reachable for the user `drop`
    names (see the module docstring); whether every one of them is."""
    uid, gid = drop[1], drop[2]
    needed = _import_paths() + [os.path.realpath(workdir)]
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
        umask = os.umask(0o022)  # the directories leading to them must be enterable
        try:
            if libc.mount(b"tmpfs", top.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                          b"size=1m,mode=0755") != 0:
                return False
            for path, handle in handles.items():
                os.makedirs(path, exist_ok=True)
                if libc.mount(f"/proc/self/fd/{handle}".encode(), path.encode(), None,
                              _MS_BIND | _MS_REC, None) != 0:
                    libc.umount2(top.encode(), _MNT_DETACH)  # all of it back, as it was
                    return False
        finally:
            os.umask(umask)
            for handle in handles.values():
                os.close(handle)
    return True


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
