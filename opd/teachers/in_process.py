"""In-process teacher engines: frozen, eval-mode, no-grad scorers inside the training ranks.

- `zero_inference`: ZeRO-3 partitioning without an optimizer; each forward gathers one layer at a
  time, and partitions may live on the host or on NVMe (`teacher.offload_param`).
- `tensor_parallel`: DeepSpeed AutoTP over all ranks. A tensor-parallel model is one model, so
  every rank must feed it the same tokens: each call scores every rank's micro-batch in turn and
  keeps its own.
- `replicated`: a full copy per rank; no collectives.

Each computes final hidden states; the loss forms teacher logits chunk by chunk from the
lm_head weight that `head()` materialises for the duration of one micro-batch's loss (the
"distribution" signal), or the top-k / sampled-token scores are formed here from the same two,
a chunk of rows at a time. Calls to `hidden_states` and `head` are collective for the first two
engines: every rank makes the same number of them (the trainer pads micro-batch counts, and
`score_conversations` pads its own).

`teacher.scoring: conversation` scores each finished conversation at collect time, as a served
teacher does, instead of each packed micro-batch: the same numbers (the tests compare both), with
scores that travel on the trajectory.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from opd.backends import load_causal_lm, resolve_precision
from opd.backends.deepspeed_comm import init_deepspeed_comm
from opd.config import Config
from opd.dist import World, all_reduce, consecutive_group
from opd.errors import ConfigError
from opd.loss import TopKTeacher
from opd.packing import PackedBatch, empty_micro_batch, pack_varlen, per_target
from opd.teachers.base import (
    FullDistribution,
    SampledLogprobs,
    SignalRequest,
    Teacher,
    TeacherScores,
    TeacherSignal,
    signal_from_hidden,
)
from opd.trajectory import AgentTrajectory


class TeacherModule(nn.Module):
    """Root for ZeRO-Inference: the decoder's final hidden states, never the [N, V] logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids):
        return self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                        use_cache=False).last_hidden_state


class InProcessTeacher(Teacher):
    hf_model: nn.Module

    def __init__(self, config: Config, model: nn.Module, world: World, dtype: torch.dtype):
        self.per_conversation = config.teacher.scoring == "conversation"
        self.micro_batch_tokens = config.train.micro_batch_tokens

    @abstractmethod
    def hidden_states(self, input_ids_1N: torch.Tensor,
                      position_ids_1N: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, H] of one packed micro-batch (no grad)."""

    def score_micro_batch(self, batch: PackedBatch, request: SignalRequest) -> TeacherSignal:
        hidden_NH = self.hidden_states(batch.input_ids, batch.position_ids)
        if request.kind == "distribution":
            return FullDistribution(hidden_NH, self.head)
        rows = batch.target_mask[0].nonzero().squeeze(-1)
        with self.head() as (weight, bias):
            scores = signal_from_hidden(hidden_NH, weight, bias, batch.input_ids[0].roll(-1),
                                        rows, request)
        # The target rows in order, as one packed sequence's scores: packing places them.
        if request.kind == "sampled":
            assert scores.logprobs_T is not None
            return SampledLogprobs(per_target(batch, [scores.logprobs_T]))
        assert scores.topk_ids_TK is not None and scores.topk_logprobs_TK is not None \
            and scores.topk_rest_T is not None
        return TopKTeacher(per_target(batch, [scores.topk_ids_TK]),
                           per_target(batch, [scores.topk_logprobs_TK]),
                           per_target(batch, [scores.topk_rest_T]))

    def score_conversations(self, trajectories: Sequence[AgentTrajectory],
                            request: SignalRequest) -> None:
        """Each trajectory's scores, from this rank's own packing of them (padded to the
        micro-batch count of the rank with most: the engine's calls are collective)."""
        batches = pack_varlen(trajectories, self.micro_batch_tokens) if trajectories else []
        most, = all_reduce([len(batches)], op="max")
        device = next(self.hf_model.parameters()).device
        # Padding batches score nothing; any token id serves.
        for batch in batches + [empty_micro_batch(0)] * int(most - len(batches)):
            batch = batch.to(device)
            hidden_NH = self.hidden_states(batch.input_ids, batch.position_ids)
            masks = batch.unpack(batch.target_mask[0])
            if request.kind == "distribution":
                for index, hidden_TH in batch.unpack(hidden_NH).items():
                    trajectories[index].teacher_scores = TeacherScores(
                        hidden_TH=hidden_TH[masks[index]].cpu())
                continue
            rows = batch.target_mask[0].nonzero().squeeze(-1)
            with self.head() as (weight, bias):
                scores = signal_from_hidden(hidden_NH, weight, bias, batch.input_ids[0].roll(-1),
                                            rows, request)
            start = 0  # rows are in packing order: each conversation's targets in turn
            for index in batch.trajectory_index:
                end = start + int(masks[index].sum())
                trajectories[index].teacher_scores = TeacherScores(
                    **{name: None if value is None else value[start:end].cpu()
                       for name, value in vars(scores).items()})
                start = end

    @classmethod
    def build(cls, config: Config, world: World) -> Teacher:
        precision = resolve_precision(config.teacher.precision, "auto", world.device)
        model = load_causal_lm(config.model.teacher, precision.dtype,
                               precision.attn_implementation, "model.teacher")
        return cls(config, model, world, precision.dtype)


def _freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


class ReplicatedTeacher(InProcessTeacher):
    def __init__(self, config: Config, model: nn.Module, world: World, dtype: torch.dtype):
        super().__init__(config, model, world, dtype)
        device = world.device
        self.hf_model = _freeze(model).to(device)
        self.scorer = TeacherModule(self.hf_model)

    @torch.no_grad()
    def hidden_states(self, input_ids_1N, position_ids_1N):
        return self.scorer(input_ids_1N, position_ids_1N)[0]

    @contextmanager
    def head(self):
        head = self.hf_model.get_output_embeddings()
        yield head.weight, head.bias


class ZeroInferenceTeacher(InProcessTeacher):
    @classmethod
    def check(cls, config: Config, world: World) -> None:
        from opd.backends.deepspeed import read_json_config  # heavy: deepspeed

        read_json_config(config.teacher.deepspeed_config, "teacher.deepspeed_config")

    def __init__(self, config: Config, model: nn.Module, world: World, dtype: torch.dtype):
        import deepspeed

        from opd.backends.deepspeed import read_json_config, zero3_config  # heavy: deepspeed

        super().__init__(config, model, world, dtype)
        teacher = config.teacher
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
    def head(self):
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


class TensorParallelTeacher(InProcessTeacher):
    """AutoTP over groups of `tp_size` ranks (one node's by default: tensor parallelism across
    nodes would put every layer's all-reduce on the slower inter-node network)."""

    @classmethod
    def check(cls, config: Config, world: World) -> None:
        tp_size = config.teacher.tp_size or world.local_world_size
        if world.world_size % tp_size:
            raise ConfigError(f"teacher.tp_size={tp_size} must divide the world size "
                              f"{world.world_size}.")

    def __init__(self, config: Config, model: nn.Module, world: World, dtype: torch.dtype):
        import deepspeed

        super().__init__(config, model, world, dtype)
        tp_size = config.teacher.tp_size or world.local_world_size
        init_deepspeed_comm(world)
        self.world = world
        self.group = consecutive_group(world, tp_size)
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
    def head(self):
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
