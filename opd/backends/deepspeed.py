"""DeepSpeed ZeRO-3 student.

The JSON in `student.deepspeed_config` holds the ZeRO tuning knobs (buckets, prefetch,
persistence); everything our config already says (batch layout, clipping, precision, offload) is
filled in here and must not appear in the file, so no value is ever written twice.

Gradient accumulation is ours: `managed_gradient_accumulation: false` makes every `backward`
accumulate (ZeRO-3 reduce-scatters into the gradient partitions) and `step` the boundary, so a
step may have any number of packed micro-batches.

Generation: with `gather=True` the whole student is gathered once for a rollout phase
(`GatheredParameters`) and ZeRO-3's module hooks are detached meanwhile. The hooks would
otherwise re-partition every submodule's parameters after its forward (they release any
available parameter not held by an active submodule) and all-gather them again on the next
decoded token: one all-gather per layer per token.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from opd.backends import (
    DistillModule,
    GenerationModel,
    StudentEngine,
    adamw_param_groups,
    load_student_model,
    save_hf,
    set_lr,
)
from opd.backends.deepspeed_comm import init_deepspeed_comm
from opd.backends.deepspeed_internals import (
    consolidated_state_dict,
    step_was_skipped,
    without_zero3_hooks,
)
from opd.config import OptimConfig, StudentConfig
from opd.dist import World
from opd.errors import CheckpointError, ConfigError, MissingFileError

# Keys our config fills in; a JSON file that sets them would say the same thing twice.
_FILLED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "bf16", "fp16", "optimizer", "scheduler",
                "managed_gradient_accumulation")
_FILLED_ZERO_KEYS = ("stage", "offload_optimizer", "offload_param")


def read_json_config(path: str, key: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise MissingFileError(f"{key}: DeepSpeed config {path} does not exist.")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} line {error.lineno} is not valid JSON ({error.msg}).") from None
    for name in _FILLED_KEYS:
        if name in data:
            raise ConfigError(f"{path}: remove '{name}'; it is filled from the recipe "
                             "(train.*, optim.grad_clip, *.precision).")
    for name in _FILLED_ZERO_KEYS:
        if name in data.get("zero_optimization", {}):
            raise ConfigError(f"{path}: remove 'zero_optimization.{name}'; it is filled from the "
                             "recipe (student.offload_*, teacher.offload_param).")
    return data


def zero3_config(base: dict, *, world_size: int, bf16: bool, offload_optimizer: str = "none",
                 offload_param: str = "none", nvme_path: str = "") -> dict:
    """A complete DeepSpeed config: the file's ZeRO knobs plus what the recipe says."""
    config = copy.deepcopy(base)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = 3
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer, "pin_memory": True}
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param, "pin_memory": True}
        if offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = nvme_path
    # One packed row per micro-batch; the number of micro-batches per step is data-dependent.
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  train_batch_size=world_size, bf16={"enabled": bf16})
    config.setdefault("steps_per_print", 2**31 - 1)
    return config


class DeepSpeedStudent(StudentEngine):
    def __init__(self, model_path: str, student: StudentConfig, optim: OptimConfig,
                 world: World):
        import deepspeed

        init_deepspeed_comm(world)
        self.world = world
        # Loaded in fp32: DeepSpeed keeps the fp32 master copy and casts to bf16 itself.
        self.hf_model, precision = load_student_model(model_path, student, world)
        self.dtype = precision.dtype  # of the exported student
        ds_config = zero3_config(
            read_json_config(student.deepspeed_config, "student.deepspeed_config"),
            world_size=world.world_size, bf16=precision.dtype == torch.bfloat16,
            offload_optimizer=student.offload_optimizer, offload_param=student.offload_param)
        ds_config.update(gradient_clipping=optim.grad_clip,
                         managed_gradient_accumulation=False)
        ds_config.setdefault("zero_allow_untested_optimizer", True)
        ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        root = DistillModule(self.hf_model)
        groups = adamw_param_groups(root, optim.weight_decay)
        optim_kwargs: dict[str, Any] = dict(lr=optim.lr, betas=(optim.betas[0], optim.betas[1]),
                                            eps=optim.eps)
        if student.offload_optimizer == "cpu" and world.device.type == "cuda":
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **optim_kwargs)
        else:
            ds_config.setdefault("zero_force_ds_cpu_optimizer", False)
            optimizer = torch.optim.AdamW(groups, **optim_kwargs)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=root, optimizer=optimizer,
                                                                 config=ds_config)
        self.root = self.engine.module
        # The loss reads the lm_head weight inside the root's forward, not through lm_head's own
        # forward: register it so ZeRO-3 gathers it for the root's forward and backward.
        for param in self.root.head.parameters():
            deepspeed.zero.register_external_parameter(self.root, param)

    def loss(self, input_ids, position_ids, head_loss):
        return self.engine(input_ids=input_ids, position_ids=position_ids, head_loss=head_loss)

    def backward(self, loss):
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, lr: float, skip: bool = False) -> tuple[float, bool]:
        # ZeRO-3 itself discards a step whose gradient norm is not finite (its `overflow`); a
        # non-finite loss has non-finite gradients, so `skip` needs nothing more here. Should
        # a step be applied anyway, the caller sees applied=True and stops the run. A skipped
        # step with finite (zero) gradients, one without target tokens, steps at lr 0: AdamW
        # then leaves every weight as it is (its moments decay by one step).
        set_lr(self.optimizer, 0.0 if skip else lr)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm, not step_was_skipped(self.optimizer)

    @contextmanager
    def generation_context(self, gather: bool):
        if not gather:
            yield GenerationModel(self.root, self.hf_model)
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.root.parameters())), \
                without_zero3_hooks(self.optimizer):
            yield self.hf_model

    def full_parameters(self):
        import deepspeed

        for prefix, module in self.hf_model.named_modules():
            named = list(module.named_parameters(recurse=False))
            if not named:
                continue
            with deepspeed.zero.GatheredParameters([param for _, param in named]):
                whole = [(f"{prefix}.{name}" if prefix else name, param.data.clone())
                         for name, param in named]
            yield from whole

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="engine", save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag="engine",
                                              load_lr_scheduler_states=False)
        if path is None:
            raise CheckpointError(f"No DeepSpeed checkpoint under {directory}.")

    def export_hf(self, directory: Path) -> None:
        state = consolidated_state_dict(self.engine)
        if self.world.is_main:
            save_hf(self.hf_model, state, directory, self.dtype)

