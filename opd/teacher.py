"""Teacher engines: frozen, eval-mode, no-grad scorers of the student's packed micro-batches.

- `zero_inference`: ZeRO-3 partitioning without an optimizer; each forward gathers one layer at a
  time, and partitions may live on the host or on NVMe (`teacher.offload_param`).
- `tensor_parallel`: DeepSpeed AutoTP over all ranks. A tensor-parallel model is one model, so
  every rank must feed it the same tokens: each call scores every rank's micro-batch in turn and
  keeps its own.
- `replicated`: a full copy per rank; no collectives.

A teacher returns final hidden states; the loss forms teacher logits chunk by chunk from the
lm_head weight that `lm_head()` materialises for the duration of one micro-batch's loss. Calls
to `hidden_states` and `lm_head` are collective for the first two engines: every rank makes the
same number of them (the trainer pads micro-batch counts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.distributed as dist
from torch import nn

from opd.backends import load_causal_lm, resolve_precision
from opd.config import TeacherConfig
from opd.dist import World, consecutive_group
from opd.errors import ConfigError


class TeacherModule(nn.Module):
    """Root for ZeRO-Inference: the decoder's final hidden states, never the [N, V] logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids):
        return self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                        use_cache=False).last_hidden_state


class Teacher(ABC):
    hf_model: nn.Module

    @abstractmethod
    def hidden_states(self, input_ids_1N: torch.Tensor,
                      position_ids_1N: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, H] of one packed micro-batch (no grad)."""

    @abstractmethod
    def lm_head(self) -> AbstractContextManager[tuple[torch.Tensor, torch.Tensor | None]]:
        """The full (weight [V, H], bias [V] | None) while the context is open."""


def _freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


class ReplicatedTeacher(Teacher):
    def __init__(self, model: nn.Module, device: torch.device):
        self.hf_model = _freeze(model).to(device)
        self.scorer = TeacherModule(self.hf_model)

    @torch.no_grad()
    def hidden_states(self, input_ids_1N, position_ids_1N):
        return self.scorer(input_ids_1N, position_ids_1N)[0]

    @contextmanager
    def lm_head(self):
        head = self.hf_model.get_output_embeddings()
        yield head.weight, head.bias


class ZeroInferenceTeacher(Teacher):
    def __init__(self, model: nn.Module, teacher: TeacherConfig, world: World,
                 dtype: torch.dtype):
        import deepspeed

        from opd.backends.deepspeed import read_json_config, zero3_config
        from opd.dist import init_deepspeed_comm

        init_deepspeed_comm(world)
        ds_config = zero3_config(
            read_json_config(teacher.deepspeed_config, "teacher.deepspeed_config"),
            world_size=world.world_size, bf16=dtype == torch.bfloat16,
            offload_param=teacher.offload_param, nvme_path=teacher.nvme_path)
        self.hf_model = _freeze(model)
        self.engine, *_ = deepspeed.initialize(model=TeacherModule(self.hf_model), config=ds_config)
        self.engine.eval()

    @torch.no_grad()
    def hidden_states(self, input_ids_1N, position_ids_1N):
        return self.engine(input_ids_1N, position_ids_1N)[0]

    @contextmanager
    def lm_head(self):
        import deepspeed

        head = self.hf_model.get_output_embeddings()
        params = [p for p in (head.weight, head.bias) if p is not None]
        with deepspeed.zero.GatheredParameters(params):
            yield head.weight, head.bias


class _TensorParallelGroup:
    """DeepSpeed's `mpu` protocol: the group the teacher is sharded over."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group


def tensor_parallel_group(world: World, tp_size: int):
    """This rank's group of `tp_size` consecutive ranks."""
    if world.world_size % tp_size:
        raise ConfigError(f"teacher.tp_size={tp_size} must divide the world size "
                          f"{world.world_size}.")
    return consecutive_group(world, tp_size)


class TensorParallelTeacher(Teacher):
    """AutoTP over groups of `tp_size` ranks (one node's by default: tensor parallelism across
    nodes would put every layer's all-reduce on the slower inter-node network)."""

    def __init__(self, model: nn.Module, world: World, dtype: torch.dtype, tp_size: int):
        import deepspeed

        from opd.dist import init_deepspeed_comm

        init_deepspeed_comm(world)
        self.world = world
        self.group = tensor_parallel_group(world, tp_size)
        # Both keys: `mpu` keeps DeepSpeed from making its own group of ranks 0..tp_size-1,
        # `tp_group` is the one AutoTP slices the weights by.
        engine = deepspeed.init_inference(
            _freeze(model), tensor_parallel={"tp_size": tp_size, "tp_group": self.group,
                                             "mpu": _TensorParallelGroup(self.group)},
            dtype=dtype, replace_with_kernel_inject=False)
        self.hf_model = engine.module
        self.hf_model.to(world.device)
        self.scorer = TeacherModule(self.hf_model)

    @torch.no_grad()
    def hidden_states(self, input_ids_1N, position_ids_1N):
        # The micro-batch of everyone in the group, padded to the longest, goes through the
        # shared model in group-rank order; each rank keeps the rows of its own.
        me = dist.get_rank(self.group)
        size = dist.get_world_size(self.group)
        local = torch.tensor([input_ids_1N.shape[1]], device=input_ids_1N.device)
        gathered = [torch.zeros_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=self.group)
        lengths = [int(n) for n in gathered]
        padded = torch.zeros((2, max(lengths)), dtype=torch.long, device=input_ids_1N.device)
        padded[0, :lengths[me]] = input_ids_1N[0]
        padded[1, :lengths[me]] = position_ids_1N[0]
        everyone = [torch.zeros_like(padded) for _ in lengths]
        dist.all_gather(everyone, padded, group=self.group)
        mine = None
        for rank, (rows, n) in enumerate(zip(everyone, lengths)):
            hidden = self.scorer(rows[0:1, :n], rows[1:2, :n])[0]
            if rank == me:
                mine = hidden
        return mine

    @contextmanager
    def lm_head(self):
        head = self.hf_model.get_output_embeddings()
        sizes = getattr(head, "_partition_sizes", None)
        if sizes is None:  # AutoTP left the head whole
            yield head.weight, head.bias
            return
        # AutoTP splits the head along the hidden dimension (LmHeadLinearAllreduce); rebuild the
        # full [V, H] in rank order.
        shard = head.weight
        padded = torch.zeros((shard.shape[0], max(sizes)), dtype=shard.dtype, device=shard.device)
        padded[:, :shard.shape[1]] = shard
        shards = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(shards, padded, group=head.mp_group)
        weight = torch.cat([s[:, :n] for s, n in zip(shards, sizes)], dim=1)
        yield weight, head.bias


def build_teacher(model_path: str, teacher: TeacherConfig, world: World) -> Teacher:
    """The teacher engine `teacher.engine` names, loaded from `model_path` (model.teacher)."""
    precision = resolve_precision(teacher.precision, "auto", world.device)
    model = load_causal_lm(model_path, precision.dtype, precision.attn_implementation,
                           "model.teacher")
    if teacher.engine == "replicated":
        return ReplicatedTeacher(model, world.device)
    if teacher.engine == "zero_inference":
        return ZeroInferenceTeacher(model, teacher, world, precision.dtype)
    return TensorParallelTeacher(model, world, precision.dtype,
                                 teacher.tp_size or world.local_world_size)
