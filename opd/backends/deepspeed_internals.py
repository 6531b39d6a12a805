"""Every private DeepSpeed API the project uses, in one place.

Checked against the DeepSpeed releases requirements.txt admits (>=0.17,<0.20); a new release
that moves one of these breaks here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def consolidated_state_dict(engine) -> dict[str, torch.Tensor]:
    """The full ZeRO-3 state dict on rank 0 in the compute dtype (collective; {} elsewhere)."""
    return engine._zero3_consolidated_16bit_state_dict()


def step_was_skipped(optimizer) -> bool:
    """Whether ZeRO-3's last `step()` discarded the update (non-finite gradient norm)."""
    return bool(optimizer.overflow)


@contextmanager
def without_zero3_hooks(optimizer) -> Iterator[None]:
    """ZeRO-3's per-module fetch/release hooks removed while the context is open.

    With every parameter already gathered, the hooks only cost time on each decode step of a
    rollout; they are registered again on exit.
    """
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    offload = optimizer.parameter_offload
    for param in iter_params(offload.module, recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        offload._register_deepspeed_module(offload.module)


def skip_shared_memory_comm_op() -> None:
    """Mark DeepSpeed's CPU shared-memory all-reduce op unavailable, so that its communication
    layer starts without compiling it (about 40 s, once per machine): one rank never
    all-reduces. `deepspeed.ops.__compatible_ops__` is the dict DeepSpeed itself consults."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def shared_memory_all_reduce_active() -> bool:
    """Whether DeepSpeed's communication layer set up its CPU shared-memory all-reduce."""
    from deepspeed import comm

    return comm.comm.cdb.shm_comm_op is not None


def disable_shared_memory_all_reduce() -> None:
    """Route every all-reduce through the process group instead of the shared-memory kernel."""
    from deepspeed import comm

    comm.comm.cdb.shm_vector_kernel_level = 0
