"""DeepSpeed's communication layer on the process group opd.dist created (ZeRO-3 student,
ZeRO-Inference teacher): the only place that starts it."""

from __future__ import annotations

import os

import torch.distributed as dist

from opd.backends.deepspeed_internals import (
    disable_shared_memory_all_reduce,
    shared_memory_all_reduce_active,
    skip_shared_memory_comm_op,
)
from opd.dist import World, barrier


def init_deepspeed_comm(world: World) -> None:
    """Hand the existing process group to DeepSpeed's communication layer."""
    import deepspeed  # heavy: imported only when a DeepSpeed engine starts
    from deepspeed import comm

    if not comm.is_initialized():
        if world.world_size == 1 and world.device.type == "cpu":
            skip_shared_memory_comm_op()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        _unlink_shared_memory_buffer(world)
    if world.local_world_size != world.world_size and world.device.type == "cpu":
        # The CPU shared-memory all-reduce needs every rank on one host; across hosts it would
        # read an uninitialised buffer, so fall back to the process group.
        disable_shared_memory_all_reduce()


def _unlink_shared_memory_buffer(world: World) -> None:
    """Remove this rank's name of DeepSpeed's CPU all-reduce buffer once every rank mapped it.

    DeepSpeed creates a 66 MiB /dev/shm file per rank, named after MASTER_ADDR/MASTER_PORT,
    and never unlinks it: every run (each on its own port) leaves them behind, in RAM, until a
    machine of 24 GiB has none left (20 GiB seen after a day of runs here). The mappings stay
    valid after the unlink; the barrier makes sure every peer has opened the file first.
    """
    if world.device.type != "cpu" or not shared_memory_all_reduce_active():
        return
    barrier()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{world.rank}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:  # not all ranks on one host: DeepSpeed created none
        pass
