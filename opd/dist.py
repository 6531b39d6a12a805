"""Process-group setup and the few collectives the trainer needs.

The same entry point runs under `deepspeed`, `torchrun`, `srun` (one task per rank) and plain
`python`: rank and world come from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
(Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID when a task was started by srun directly),
and a process started without them is a world of one.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from opd.errors import ConfigError

COLLECTIVE_TIMEOUT_MIN = 60  # until the first step passed (loading, first compile, prepare)


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_port(port: int) -> None:
    """Rank 0 binds MASTER_PORT for the rendezvous store: a busy port is one sentence here
    rather than a traceback on rank 0 and a long wait on the others."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds it
        try:
            sock.bind(("", port))
        except OSError as error:
            raise ConfigError(f"MASTER_PORT {port} is not free on this host ({error.strerror}; "
                              "another job's rendezvous?): give the launcher another "
                              "--master_port.") from None


def _launcher_env() -> None:
    """Fill the torch.distributed environment from Slurm, or as a world of one."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_ADDR" not in env:
            raise RuntimeError("Started by srun without a launcher: export MASTER_ADDR (the first "
                               "node's hostname) and MASTER_PORT before srun.")
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    if "RANK" not in env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", env["WORLD_SIZE"]))
    # DeepSpeed's CPU shared-memory all-reduce (tensor-parallel inference) only initialises when
    # LOCAL_SIZE equals the world size, yet runs either way; torchrun does not set it.
    env.setdefault("LOCAL_SIZE", env["LOCAL_WORLD_SIZE"])


def init_world(device: str = "auto", backend: str = "auto", threads: int = 0) -> World:
    """Join (or create) the default process group; idempotent."""
    _launcher_env()
    env = os.environ
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank, local_world_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        where = torch.device("cuda", local_rank)
    else:
        where = torch.device("cpu")
    if threads or where.type == "cpu":
        # Ranks on one host share its cores; oversubscribed BLAS threads slow every rank down.
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world_size))
    # Under torchrun the agent holds the store already (the port is its, and busy by design).
    if not dist.is_initialized() and rank == 0 and \
            env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        _check_port(int(env["MASTER_PORT"]))
    if not dist.is_initialized():
        chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        # Long enough for the waits on rank 0's work (prepare, eval) at a barrier.
        dist.init_process_group(chosen, rank=rank, world_size=world_size,
                                device_id=where if use_cuda else None,
                                timeout=timedelta(minutes=COLLECTIVE_TIMEOUT_MIN))
    return World(rank, world_size, local_rank, local_world_size, where)


def shorten_timeout(seconds: float) -> None:
    """Once the first step passed: a rank that stops responding (hung, stopped, its host gone)
    fails the others after `seconds` (cluster.collective_timeout_s), not after an hour of
    silence, and the error says so in one sentence."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for group in list(dist.distributed_c10d._world.pg_map):  # the default one and subgroups
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    explained, rank = sys.excepthook, dist.get_rank()

    def explain(kind, error, trace) -> None:
        text = str(error).lower() if isinstance(error, RuntimeError) else ""
        if "timed out" in text:
            cause = (f"waited {seconds:g} s (cluster.collective_timeout_s) for a collective: "
                     "another rank stopped responding (hung, stopped or its host lost)")
        elif "closed by peer" in text:
            cause = "lost another rank in a collective: it exited (see its log)"
        else:
            return explained(kind, error, trace)
        print(f"error: rank {rank} {cause}; resume from the last checkpoint with the "
              "same command.", file=sys.stderr, flush=True)
    sys.excepthook = explain


def shutdown() -> None:
    """Destroy the process groups while the interpreter is whole.

    Engines keep collective work handles in reference cycles (module hooks); freed later, during
    interpreter finalization, a gloo work object that still holds tensors aborts the process
    ("terminate called without an active exception"), so collect them first.
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce(values: list[float], op: str = "sum",
               device: torch.device | None = None) -> list[float]:
    """Element-wise sum or max of a few floats over all ranks (float64 on the wire)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device or _comm_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lockstep() -> Callable[[bool], bool]:
    """`sync(has_work) -> any rank has work`: one all-reduce MAX per collective forward step."""
    def sync(has_work: bool) -> bool:
        return all_reduce([float(has_work)], op="max")[0] > 0
    return sync


def broadcast_object(value, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(value) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def consecutive_group(world: World, size: int, backend: str | None = None):
    """This rank's group of `size` consecutive ranks (every rank creates every group, as
    `new_group` requires). `size` must divide the world size."""
    mine = None
    for start in range(0, world.world_size, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks, backend=backend)
        if world.rank in ranks:
            mine = group
    return mine
