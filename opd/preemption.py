"""Preemption-safe stopping: a signal asks, every rank agrees at a step boundary, then checkpoint.

Slurm warns a job before its time limit with the signal the sbatch file asks for (`#SBATCH
--signal=USR1@120`), and ends a job (scancel, preemption) with SIGTERM. Both only set a flag here:
stopping in the middle of a step, or of a checkpoint, would leave ranks out of step. At each step
boundary the trainer asks `stop_requested()`, a MAX all-reduce of the flags, so that all ranks
stop after the same step even when only some were signalled, and writes a checkpoint. Then:
- USR1 (the time-limit warning, or `scancel --signal=USR1 JOB` by hand): `requeue()`, and the job
  restarts from that checkpoint.
- SIGTERM: the run ends there, not requeued. It is what `scancel` sends, and a job that requeued
  itself on it could never be cancelled; a cluster that preempts with PreemptMode=REQUEUE
  requeues the job itself, and the new start resumes from the checkpoint all the same.
A launcher that dies under its ranks (the `deepspeed` runner on SIGTERM, or torchrun or
deepspeed's launcher on SIGUSR1, whose default action kills them) would leave the ranks training
on, detached. So `install()` also watches the launcher processes above a rank (a pidfd each; only
under torchrun or deepspeed, not under a shell, where `nohup` is legitimate) and treats their exit
as SIGTERM: checkpoint at the next step boundary, end.
A rank that cannot reach a step boundary in time is ended by SIGKILL, from its launcher (torchrun
waits 30 s after forwarding SIGTERM) or from Slurm (KillWait); the checkpoint it was writing, if
any, stays invisible to resume (opd.checkpoint writes atomically).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch.distributed as dist

from opd.dist import all_reduce

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# Set by launch/slurm/node.sh (e.g. "USR2"): the signal it relays Slurm's warning (USR1) as.
RELAYED_WARNING = "OPD_WARNING_SIGNAL"

_received: list[str] = []  # names of the stop signals this process got, in order
_relayed_warning: int | None = None  # the signal number recorded as SIGUSR1 (node.sh's relay)
LAUNCHER_EXITED = "launcher exited"  # recorded like a signal name; stops as SIGTERM does


def _on_signal(signum: int, frame) -> None:
    _received.append("SIGUSR1" if signum == _relayed_warning else signal.Signals(signum).name)


def install(signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Turn `signals` into a stop request; call once from the main thread before training.

    Under launch/slurm/node.sh ($OPD_WARNING_SIGNAL set) USR1 stays ignored, as node.sh left it:
    Slurm sends its warning to every process of the job step, and the processes a rank starts (an
    op's compiler, a tool sandbox, wandb's service) inherit an ignored signal across exec but
    would die of a handled one. node.sh relays the warning to the ranks alone as
    $OPD_WARNING_SIGNAL, which is handled here and recorded as SIGUSR1.
    """
    global _relayed_warning
    relayed = os.environ.get(RELAYED_WARNING)
    for signum in signals:
        if signum == signal.SIGUSR1 and relayed:
            signum = _relayed_warning = signal.Signals[f"SIG{relayed}"]
        signal.signal(signum, _on_signal)
        # Restart interrupted system calls: a signal must not fail a collective in flight.
        signal.siginterrupt(signum, False)
    _watch_launchers()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent_of(pid: int) -> int:
    try:  # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def launchers() -> list[int]:
    """The launcher processes above this rank: torchrun's agent; or deepspeed's per-node launcher
    and, above it, the `deepspeed` runner. None when started by a shell, srun or by hand."""
    parent = os.getppid()
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return [parent]
    if "deepspeed.launcher.launch" in _cmdline(parent):
        runner = _parent_of(parent)
        return [parent, runner] if "deepspeed" in _cmdline(runner) else [parent]
    return []


def _watch_launchers() -> None:
    """A daemon thread that records LAUNCHER_EXITED once any launcher above this rank exits."""
    pids = launchers()
    if not pids:
        return
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:  # gone already: a pidfd of it would never become readable
            fds = []
            break

    def watch() -> None:
        if fds:
            select.select(fds, [], [])  # a pidfd turns readable when its process exits
        _received.append(LAUNCHER_EXITED)
        print(f"opd: rank {os.environ.get('RANK', '?')}: the launcher exited; stopping after this "
              "step with a checkpoint.", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="opd-launcher-watch", daemon=True).start()


def received() -> str | None:
    """The first stop signal this process got (e.g. "SIGUSR1"), or None."""
    return _received[0] if _received else None


REQUEUE, END = "requeue", "end"


def stop_requested() -> str | None:
    """None to go on, else how every rank stops after this step: END when any rank
    got SIGTERM, REQUEUE when any got USR1. Collective: every rank calls it each step."""
    ending = "SIGTERM" in _received or LAUNCHER_EXITED in _received
    local = 2.0 if ending else 1.0 if "SIGUSR1" in _received else 0.0
    local, = all_reduce([local], op="max")
    return {0.0: None, 1.0: REQUEUE, 2.0: END}[local]


def after_checkpoint(stop: str) -> bool:
    """Once the stop checkpoint is complete: requeue (REQUEUE) or say how to resume (END).
    Returns whether the job was requeued."""
    if stop == REQUEUE:
        return requeue()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print("Stopped by SIGTERM (or the launcher's exit) after a checkpoint; the job is not "
              "requeued (scancel ends it). "
              "Run or submit the same command again to resume.", file=sys.stderr, flush=True)
    return False


def requeue() -> bool:
    """Ask Slurm to run this job again; call after the stop checkpoint is complete.

    Any rank may call it; only global rank 0 asks. Slurm then ends the running job and later
    starts it afresh, and the trainer resumes from the newest complete checkpoint. Returns
    whether the job was requeued: outside Slurm, or when Slurm refuses (a job submitted with
    --no-requeue, or already cancelled), it says how to resume by hand instead.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return False
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print("Stopped on request after a checkpoint; run the same command again to resume.",
              file=sys.stderr, flush=True)
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        failure = str(error)
    else:
        if result.returncode == 0:
            print(f"Stopped after a checkpoint; Slurm job {job} requeued to resume from it.",
                  file=sys.stderr, flush=True)
            return True
        failure = result.stderr.strip() or f"exit status {result.returncode}"
    print(f"Stopped after a checkpoint, but `scontrol requeue {job}` failed ({failure}); "
          "submit the job again to resume.", file=sys.stderr, flush=True)
    return False
