"""Pre-flight checks: what would fail a run late, or silently, is one sentence before engines start.

`check(config, world)` (collective) runs after the prepare step, before any engine is built:
- The run directory: one that holds another run's results (checkpoints or `final/`) is refused
  unless its `config.yaml` matches this config on every key that shapes training
  (`config_conflict`); else a sweep over `optim.lr` that shares `runs/<name>` would silently
  resume the first run, train 0 steps and overwrite its config. To start a new run, set another
  `logging.run_dir`: nothing here deletes results, on a shared cluster that is for a person to do.
  To continue a run on purpose with a changed config, name its checkpoint (`checkpoint.resume=DIR`).
- The run and checkpoint directories are writable, on every rank (every rank writes its shards).
- `logging.wandb_mode=online`: an API key must be there (WANDB_API_KEY or ~/.netrc), and wandb's
  host must answer within a few seconds; when it does not, the run logs offline (`wandb sync`
  later) instead of waiting for wandb's own timeout and then failing.
The rendezvous port is checked earlier, by opd.dist.init_world, before the process group starts.
"""

from __future__ import annotations

import dataclasses
import netrc
import os
import socket
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import yaml

from opd.config import Config, ConfigError, WandbMode, to_yaml
from opd.dist import World, all_gather_objects, broadcast_object

# Keys that may change when a run resumes: more steps, logging, evaluation, the cluster it runs on
# (and the memory settings a cluster file sets); none changes what a finished step computed.
MAY_DIFFER = ("train.steps", "logging.", "eval.", "cluster.", "checkpoint.every",
              "checkpoint.keep", "checkpoint.resume", "student.offload_optimizer",
              "student.offload_param", "student.gradient_checkpointing", "teacher.offload_param",
              "teacher.nvme_path", "tools.num_workers", "rollout.vllm_schedule",
              # where a served teacher runs and how it is reached: a requeued Slurm job's
              # teacher nodes, so its URLs, may differ from the first start's
              "teacher.urls", "teacher.timeout_s", "teacher.retries", "teacher.startup_timeout_s",
              "teacher.in_flight", "teacher.gpu_memory_utilization")
WANDB_PROBE_S = 5.0


class _Unset:
    """A key one of two configs lacks."""

    def __repr__(self) -> str:
        return "unset"


UNSET = _Unset()


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _holds_results(run_dir: Path) -> bool:
    checkpoints = run_dir / "checkpoints"
    return (run_dir / "final").exists() or (checkpoints.is_dir() and any(
        p.name.startswith("step-") for p in checkpoints.iterdir()))


def config_conflict(config: Config, run_dir: Path) -> str | None:
    """Why this config must not start in `run_dir`, or None."""
    stored_path = run_dir / "config.yaml"
    if not stored_path.is_file() or not _holds_results(run_dir):
        return None  # nothing of another run to keep (a run that failed before any checkpoint)
    if config.checkpoint.resume == "never":
        return (f"logging.run_dir {run_dir} holds a run's results and checkpoint.resume=never "
                "would overwrite them; set logging.run_dir to a new directory to start afresh.")
    if config.checkpoint.resume != "auto":
        return None  # a checkpoint named on purpose: continue it with this config
    try:
        stored = _flat(yaml.safe_load(stored_path.read_text()) or {})
    except yaml.YAMLError:
        return f"{stored_path} is not valid YAML; move it away or choose another logging.run_dir."
    current = _flat(yaml.safe_load(to_yaml(config)))
    # Every key either side has: an empty mapping the other side fills ({} -> enable_thinking:
    # false), or a key the stored config lacks, changes what a step computes as much as a value.
    for key in [*current, *(key for key in stored if key not in current)]:
        was, now = stored.get(key, UNSET), current.get(key, UNSET)
        if was != now and not key.startswith(MAY_DIFFER):
            return (f"logging.run_dir {run_dir} holds another run ({key} was {was!r}, now "
                    f"{now!r}): run with its config to resume it, or set logging.run_dir to a "
                    "new directory to start a new run.")
    return None



def _unwritable(key: str, path: Path) -> str | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as error:
        return f"{key}: cannot write to {path} ({error.strerror or error})."
    return None


def writable_problem(config: Config) -> str | None:
    """The first directory of the run this process cannot write, as one sentence, or None."""
    paths = [("logging.run_dir", config.run_dir), ("logging.run_dir", config.run_dir / "checkpoints")]
    if config.teacher.offload_param == "nvme":
        paths.append(("teacher.nvme_path", Path(config.teacher.nvme_path)))
    return next((p for key, path in paths if (p := _unwritable(key, path))), None)


def _wandb_host() -> tuple[str, int]:
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def _has_wandb_key(host: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(config: Config) -> WandbMode:
    """The wandb mode to run with: online only with a key and a host that answers."""
    if config.logging.wandb_mode != "online":
        return config.logging.wandb_mode
    host, port = _wandb_host()
    if not _has_wandb_key(host):
        raise ConfigError("logging.wandb_mode=online needs a wandb API key: run `wandb login` or "
                          "export WANDB_API_KEY, or set logging.wandb_mode=offline.")
    try:
        socket.create_connection((host, port), timeout=WANDB_PROBE_S).close()
    except OSError as error:
        print(f"warning: wandb host {host}:{port} is unreachable ({error}); logging offline "
              "instead (upload later with `wandb sync`).", file=sys.stderr, flush=True)
        return "offline"
    return "online"


def check(config: Config, world: World) -> Config:
    """Collective: raise `ConfigError` (the same on every rank) or return the config to run."""
    problem = next((p for p in all_gather_objects(writable_problem(config)) if p), None)
    if problem is None and world.is_main:
        problem = config_conflict(config, config.run_dir)
        try:
            if problem is None:
                config = dataclasses.replace(config, logging=dataclasses.replace(
                    config.logging, wandb_mode=wandb_mode(config)))
        except ConfigError as error:
            problem = str(error)
    problem, config = broadcast_object((problem, config))
    if problem:
        raise ConfigError(problem)
    return config
