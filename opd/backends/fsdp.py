"""PyTorch FSDP2 student: `fully_shard` per decoder layer, then the root.

Mixed precision computes in bf16 on GPU and reduces gradients in fp32; the sharded parameters
stay fp32 and are the optimizer's master copy. FSDP2 has one offload policy, so either
`student.offload_*` moves parameters, gradients and the optimizer step to the host.

Generation with `gather=True` unshards every layer once and turns off resharding after forward
for the rollout phase, so decoding a token runs no collective at all.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from opd.backends import (
    DistillModule,
    GenerationModel,
    StudentEngine,
    adamw_param_groups,
    decoder_layers,
    load_student_model,
    save_hf,
    set_lr,
)
from opd.config import OptimConfig, StudentConfig
from opd.dist import World
from opd.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class FSDPStudent(StudentEngine):
    def __init__(self, model_path: str, student: StudentConfig, optim: OptimConfig,
                 world: World):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        self.world = world
        self.hf_model, precision = load_student_model(model_path, student, world)
        self.dtype = precision.dtype  # of the exported student
        mesh = init_device_mesh(world.device.type, (world.world_size,))
        # On a CPU-only host everything already lives in host memory.
        offload = "cpu" in (student.offload_optimizer, student.offload_param) \
            and world.device.type == "cuda"
        shard_kwargs: dict[str, Any] = dict(
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
        self.layers = [fully_shard(layer, **shard_kwargs)
                       for layer in decoder_layers(self.hf_model)]
        self.root = DistillModule(self.hf_model)
        fully_shard(self.root, **shard_kwargs)  # in place: the root keeps its own type
        self.optimizer = torch.optim.AdamW(
            adamw_param_groups(self.root, optim.weight_decay), lr=optim.lr,
            betas=(optim.betas[0], optim.betas[1]), eps=optim.eps, foreach=False)
        self.grad_clip = optim.grad_clip
        # FSDP elects its root at the first forward: run one through the real root now, so a
        # rollout that calls the layers directly cannot elect a layer.
        with torch.no_grad():
            self.root(generate={"input_ids": torch.zeros((1, 1), dtype=torch.long,
                                                         device=world.device),
                                "use_cache": False, "logits_to_keep": 1})

    def loss(self, input_ids, position_ids, head_loss):
        return self.root(input_ids=input_ids, position_ids=position_ids, head_loss=head_loss)

    def backward(self, loss):
        loss.backward()

    def step(self, lr: float, skip: bool = False) -> tuple[float, bool]:
        set_lr(self.optimizer, lr)
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        total = torch.nn.utils.clip_grad_norm_(self.root.parameters(), max_norm)
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        applied = not skip and math.isfinite(norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, applied

    @contextmanager
    def generation_context(self, gather: bool):
        if not gather:
            yield GenerationModel(self.root, self.hf_model)
            return
        modules = [*self.layers, cast("FSDPModule", self.root)]  # fully_shard re-classed it
        for module in modules:
            module.unshard()
        for layer in self.layers:
            layer.set_reshard_after_forward(False, recurse=False)
        try:
            yield self.hf_model
        finally:
            for layer in self.layers:
                layer.set_reshard_after_forward(True, recurse=False)
            for module in modules:
                module.reshard()

    def full_parameters(self):
        for name, param in self.hf_model.named_parameters():
            yield name, param.full_tensor() if hasattr(param, "full_tensor") else param.data

    def _state(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        return get_state_dict(self.root, self.optimizer)

    def save(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        model_state, optim_state = self._state()
        dcp.save({"model": model_state, "optim": optim_state},
                 checkpoint_id=str(directory / "fsdp"))

    def load(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not (directory / "fsdp").is_dir():
            raise CheckpointError(f"No FSDP checkpoint under {directory}.")
        model_state, optim_state = self._state()
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(directory / "fsdp"))
        set_state_dict(self.root, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def export_hf(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            self.root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.world.is_main:
            save_hf(self.hf_model, state, directory, self.dtype)
