"""opd.preemption on 2 gloo ranks: a signal to one rank stops both after the same step.

USR1 requeues the job; SIGTERM (scancel) only checkpoints and ends it.

The ranks run a fake training loop that calls the module exactly as the trainer does (stop check
at each step boundary, checkpoint, requeue); `scontrol` is a stand-in script on PATH that
records its arguments, so these tests need no Slurm (tests/test_slurm.py runs the real one).
Run as a script, this file is one rank of that loop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 3000  # far more than the test lets pass before it signals


def fake_training(run_dir: Path) -> None:
    """One rank: a collective per step, then the trainer's step-boundary protocol."""
    import torch
    import torch.distributed as dist

    from opd import preemption

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    preemption.install()
    rank = dist.get_rank()
    for step in range(1, MAX_STEPS + 1):
        work = torch.ones(4096)
        dist.all_reduce(work)
        (run_dir / f"rank{rank}.step").write_text(str(step))
        time.sleep(0.01)
        last = step == MAX_STEPS
        stop = None if last else preemption.stop_requested()
        if last or stop:
            (run_dir / f"checkpoint-rank{rank}").write_text(str(step))
            dist.barrier()
        if stop:
            requeued = preemption.after_checkpoint(stop)
            result = {"step": step, "requeued": requeued, "signal": preemption.received()}
            (run_dir / f"rank{rank}.json").write_text(json.dumps(result))
            break
    dist.destroy_process_group()



def _fake_scontrol(bin_dir: Path, log: Path, exit_code: int = 0) -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                      f'[ {exit_code} -eq 0 ] || echo "scontrol: error: Job not requeueable" >&2\n'
                      f"exit {exit_code}\n")
    script.chmod(0o755)


def _wait_for(predicate, what: str, procs, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if any(p.poll() not in (None, 0) for p in procs):
            raise AssertionError(f"a rank failed while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def _step(run_dir: Path, rank: int) -> int:
    try:
        return int((run_dir / f"rank{rank}.step").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_signal_to_one_rank_stops_all_ranks_after_the_same_step(tmp_path, signum):
    log = tmp_path / "scontrol.log"
    _fake_scontrol(tmp_path / "bin", log)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), SLURM_JOB_ID="4242", PYTHONPATH=str(REPO),
                   PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        procs.append(subprocess.Popen([sys.executable, __file__, str(tmp_path)], env=env))
    try:
        _wait_for(lambda: min(_step(tmp_path, 0), _step(tmp_path, 1)) >= 3, "step 3", procs)
        procs[1].send_signal(signum)
        for proc in procs:
            assert proc.wait(timeout=120) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert results[0]["step"] == results[1]["step"] < MAX_STEPS
    assert results[1]["signal"] == signal.Signals(signum).name
    assert results[0]["signal"] is None  # rank 0 was never signalled, yet it stopped
    for rank in range(2):
        assert int((tmp_path / f"checkpoint-rank{rank}").read_text()) == results[0]["step"]
    if signum == signal.SIGUSR1:  # Slurm's time-limit warning: requeue
        assert [r["requeued"] for r in results] == [True, False]  # only rank 0 asks Slurm
        assert log.read_text().splitlines() == ["requeue 4242"]
    else:  # scancel: checkpoint, then end for good
        assert [r["requeued"] for r in results] == [False, False]
        assert not log.exists()


def test_sigterm_ends_the_run_even_after_usr1(monkeypatch):
    from opd import preemption

    monkeypatch.setattr(preemption, "_received", [])
    assert preemption.stop_requested() is None
    preemption._on_signal(signal.SIGUSR1, None)
    assert preemption.stop_requested() == preemption.REQUEUE
    preemption._on_signal(signal.SIGTERM, None)
    assert preemption.stop_requested() == preemption.END


def test_requeue_outside_slurm_says_how_to_resume(monkeypatch, capsys):
    from opd import preemption

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert preemption.requeue() is False
    assert "run the same command again to resume" in capsys.readouterr().err


def test_requeue_refused_by_slurm_names_the_command_and_the_reason(tmp_path, monkeypatch, capsys):
    from opd import preemption

    log = tmp_path / "scontrol.log"
    _fake_scontrol(tmp_path / "bin", log, exit_code=1)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert preemption.requeue() is False
    err = capsys.readouterr().err
    assert "`scontrol requeue 77` failed (scontrol: error: Job not requeueable)" in err
    assert log.read_text().splitlines() == ["requeue 77"]


if __name__ == "__main__":
    fake_training(Path(sys.argv[1]))
