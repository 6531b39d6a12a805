"""Student engines: a sharded Hugging Face causal LM that trains on a distillation loss and samples.

Both engines (DeepSpeed ZeRO-3 in `deepspeed.py`, FSDP2 in `fsdp.py`) wrap the model in
`DistillModule`, the root module their sharding hooks see. Its forward runs the decoder and hands
the final hidden states, with the lm_head weight gathered by the root's own hooks, to a loss
callable: no [tokens, vocab] logits tensor is ever formed here, and the lm_head is materialised
only while the root forward (and its backward) runs.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# (hidden_NH, weight_VH, bias_V | None) -> (loss_sum, target_count), both 0-d tensors
HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None],
                    tuple[torch.Tensor, torch.Tensor]]


class DistillModule(nn.Module):
    """Root module of a student: `forward` computes a loss from hidden states, or generates."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, head_loss: HeadLoss | None = None,
                generate: dict | None = None):
        if generate is not None:
            return self.model(**generate)
        hidden_1NH = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                              use_cache=False).last_hidden_state
        hidden_NH = hidden_1NH[0]
        loss_sum, count = head_loss(hidden_NH, self.head.weight, self.head.bias)
        if not loss_sum.requires_grad or count.item() == 0:
            # A micro-batch without targets must still send a (zero) gradient to every
            # parameter: ZeRO-3 and FSDP reduce gradients with collectives every rank joins.
            untouched = hidden_NH.sum() + sum(p.sum() for p in self.head.parameters())
            loss_sum = loss_sum + 0.0 * untouched
        return loss_sum, count


class GenerationModel:
    """What the rollout calls: routes each forward through the root so per-step gathering runs.

    `module` is the unwrapped model (the rollout reads its device and toggles eval mode).
    """

    def __init__(self, root: Callable, module: nn.Module):
        self._root, self.module = root, module

    def __call__(self, **kwargs):
        return self._root(generate=kwargs)


class StudentEngine(ABC):
    """A sharded student: loss forward, backward, optimizer step, generation, checkpoints."""

    hf_model: nn.Module  # the unwrapped Hugging Face model (config, generation_config)

    @abstractmethod
    def loss(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
             head_loss: HeadLoss) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one packed micro-batch; returns (loss_sum, target_count)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (already normalised by the caller)."""

    @abstractmethod
    def step(self, lr: float) -> float:
        """Clip, apply the accumulated gradients at learning rate `lr`; returns the grad norm."""

    @abstractmethod
    def generation_context(self, gather: bool) -> AbstractContextManager:
        """Yields the model the rollout calls: the whole student gathered once (gather=True),
        or gathered layer by layer on every forward (gather=False: ranks call in lockstep)."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Every rank writes its shard of parameters and optimizer state under `directory`."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (same world size)."""

    @abstractmethod
    def export_hf(self, directory: Path) -> None:
        """Consolidate the full student on rank 0 and write it with `save_pretrained`."""

    def train_mode(self) -> None:
        self.hf_model.train()


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype  # the compute (and, for DeepSpeed, the parameter) dtype
    attn_implementation: str


def resolve_precision(precision: str, attn_implementation: str, device: torch.device) -> Precision:
    """bf16 and flash-attn varlen on GPU when available; fp32 and SDPA on CPU."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if attn_implementation == "auto":
        flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        attn_implementation = "flash_attention_2" if flash else "sdpa"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return Precision(dtype, attn_implementation)


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str, key: str) -> nn.Module:
    """A Hugging Face causal LM from a local directory (never the hub)."""
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{key}: {path} is not a Hugging Face model directory "
                                "(no config.json); run the recipe's prepare step or fix the path.")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                attn_implementation=attn_implementation)


def adamw_param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms and biases keep their scale."""
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def decoder_layers(model: nn.Module) -> Iterator[nn.Module]:
    """The repeated transformer blocks (the unit of sharding and of the largest gather)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers to shard "
                         "(expected model.get_decoder().layers)")
    return iter(layers)


def build_student(config, world) -> StudentEngine:
    if config.student.backend == "deepspeed":
        from opd.backends.deepspeed import DeepSpeedStudent
        return DeepSpeedStudent(config, world)
    from opd.backends.fsdp import FSDPStudent
    return FSDPStudent(config, world)


def _count(path: str) -> tuple[int, int] | None:
    """(total parameters, largest decoder layer) of a model directory, built on the meta device."""
    if not (Path(path) / "config.json").is_file():
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    total = sum(p.numel() for p in model.parameters())
    largest = max([sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
                  + [model.get_output_embeddings().weight.numel()])
    return total, largest


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def student_memory(parameters: int, largest_layer: int, world_size: int, *, bf16: bool,
                   backend: str, offload_optimizer: str) -> dict[str, float]:
    """Bytes per rank of the student's model states, and where they live.

    DeepSpeed keeps bf16 parameter and gradient partitions plus an fp32 master and two fp32 Adam
    moments (2 + 2 + 12 bytes per parameter over the world); FSDP2 keeps fp32 shards as the
    master (4 + 4 + 8). Training in fp32 needs no separate master (4 + 4 + 8). A gathered layer
    (and the one being prefetched) adds two full layers on the device.
    """
    compute = 2 if bf16 else 4
    master = 4 if bf16 and backend == "deepspeed" else 0
    param_bytes = compute if backend == "deepspeed" else 4
    states = {"params": parameters * param_bytes / world_size,
              "grads": parameters * (compute if backend == "deepspeed" else 4) / world_size,
              "optimizer": parameters * (8 + master) / world_size}
    working = 2 * largest_layer * compute
    offloaded = states["optimizer"] + states["grads"] if offload_optimizer == "cpu" else 0.0
    return {**states, "device": states["params"] + states["grads"] + states["optimizer"]
            - offloaded + working, "host": offloaded,
            "gather_once": parameters * compute}


def memory_estimate(config, world_size: int, device: str) -> list[str]:
    """Lines of per-rank model-state memory for the student and the teacher (dry run)."""
    def bf16(precision: str) -> bool:
        return precision == "bf16" or (precision == "auto" and device == "cuda")

    lines = []
    student = _count(config.model.student)
    if student is None:
        lines.append(f"student: {config.model.student} not found (the recipe's prepare step "
                     "has not built it yet)")
    else:
        n, largest = student
        mixed = bf16(config.student.precision)
        lines.append(f"student: {n / 1e6:.1f}M parameters, {config.student.backend} sharded over "
                     f"{world_size} ranks, {'bf16' if mixed else 'fp32'}")
        for offload in ("none", "cpu"):
            m = student_memory(n, largest, world_size, bf16=mixed,
                               backend=config.student.backend, offload_optimizer=offload)
            chosen = " (chosen)" if offload == config.student.offload_optimizer else ""
            lines.append(f"  optimizer offload {offload}{chosen}: params {_size(m['params'])} + "
                         f"grads {_size(m['grads'])} + Adam {_size(m['optimizer'])} -> device "
                         f"{_size(m['device'])}, host {_size(m['host'])} per rank")
        lines.append(f"  rollout gather-once holds the whole student: +{_size(m['gather_once'])} "
                     "on device (student.generation_gather=per_step if that does not fit)")
    teacher = _count(config.model.teacher)
    if teacher is None:
        lines.append(f"teacher: {config.model.teacher} not found (the recipe's prepare step "
                     "has not built it yet)")
    else:
        n, largest = teacher
        b = 2 if bf16(config.teacher.precision) else 4
        engine = config.teacher.engine
        share = n * b if engine == "replicated" else n * b / world_size
        where = {"cpu": "host", "nvme": "NVMe"}.get(config.teacher.offload_param, "device")
        lines.append(f"teacher: {n / 1e6:.1f}M parameters, {engine}: {_size(share)} per rank on "
                     f"{where}, + {_size(largest * b)} for the largest gathered layer or lm_head")
    return lines
