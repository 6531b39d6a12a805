"""Student engines: a sharded Hugging Face causal LM that trains on a distillation loss and samples.

Both engines (DeepSpeed ZeRO-3 in `deepspeed.py`, FSDP2 in `fsdp.py`) wrap the model in
`DistillModule`, the root module their sharding hooks see. Its forward runs the decoder and hands
the final hidden states, with the lm_head weight gathered by the root's own hooks, to a loss
callable: no [tokens, vocab] logits tensor is ever formed here, and the lm_head is materialised
only while the root forward (and its backward) runs.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from opd.config import OptimConfig, StudentConfig
from opd.dist import World
from opd.errors import MissingFileError, ModelFileError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# (hidden_NH, weight_VH, bias_V | None) -> (loss_sum, target_count), both 0-d tensors
HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None],
                    tuple[torch.Tensor, torch.Tensor]]


class DistillModule(nn.Module):
    """Root module of a student: `forward` computes a loss from hidden states, or generates."""

    def __init__(self, model: PreTrainedModel):
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
        assert head_loss is not None, "a training forward needs head_loss"
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

    hf_model: PreTrainedModel  # the unwrapped Hugging Face model (config, generation_config)
    dtype: torch.dtype  # the compute dtype, and that of the exported student

    @abstractmethod
    def loss(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
             head_loss: HeadLoss) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one packed micro-batch; returns (loss_sum, target_count)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (already normalised by the caller)."""

    @abstractmethod
    def step(self, lr: float, skip: bool = False) -> tuple[float, bool]:
        """Clip and apply the accumulated gradients at learning rate `lr`, unless their global
        norm is not finite or `skip` is set; then discard them. Returns (grad norm, applied)."""

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
    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of the Hugging Face model, whole, by its Hugging Face name: gathered
        a module (or a tensor) at a time, so a rank never holds the whole model at once. Every
        rank must iterate to the end (the gathers are collectives)."""

    @abstractmethod
    def export_hf(self, directory: Path) -> None:
        """Consolidate the full student on rank 0 and write it with `save_pretrained`."""

    def train_mode(self) -> None:
        self.hf_model.train()


def load_student_model(model_path: str, student: StudentConfig,
                       world: World) -> tuple[PreTrainedModel, Precision]:
    """The student in fp32 (the engines keep fp32 masters and cast to the compute dtype)."""
    precision = resolve_precision(student.precision, student.attn_implementation, world.device)
    model = load_causal_lm(model_path, torch.float32, precision.attn_implementation,
                           "model.student")
    if student.gradient_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model, precision


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def save_hf(model: PreTrainedModel, root_state: dict, directory: Path, dtype: torch.dtype) -> None:
    """`save_pretrained` from a consolidated state dict of the `DistillModule` root, in the
    training precision `dtype`: the consolidated state (FSDP's fp32 master) and the live model
    (loaded in fp32) would otherwise make a bf16 student twice its size on disk."""
    prefix = "model."
    model.save_pretrained(directory, state_dict={
        name[len(prefix):]: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in root_state.items()})
    # save_pretrained records the live model's dtype; config.json must say what the files hold.
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(directory)


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


def check_model_dir(path: str | Path, key: str) -> Path:
    """`path` as a Hugging Face model directory whose config.json parses, or one sentence."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise MissingFileError(f"{key}: {path} is not a Hugging Face model directory (no "
                               "config.json); run the recipe's prepare step or fix the path.")
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        parsed = None
    if not isinstance(parsed, dict):
        raise ModelFileError(f"{key}: {config} is not a JSON object (a damaged or partly copied "
                             "model directory?).")
    return Path(path)


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str,
                   key: str) -> PreTrainedModel:
    """A Hugging Face causal LM from a local directory (never the hub)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    check_model_dir(path, key)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                    attn_implementation=attn_implementation)
    except (OSError, SafetensorError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelFileError(f"{key}: cannot load the model in {path} ({reason[:200]}); its "
                             "files are damaged or incomplete (a truncated or partial copy?)."
                             ) from None


def adamw_param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms and biases keep their scale."""
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def decoder_layers(model: PreTrainedModel) -> Iterator[nn.Module]:
    """The repeated transformer blocks (the unit of sharding and of the largest gather)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers to shard "
                         "(expected model.get_decoder().layers)")
    return iter(layers)


def check_student(student: StudentConfig) -> None:
    """Refuse, before any engine starts, a student engine config that cannot work."""
    if student.backend == "deepspeed":
        from opd.backends.deepspeed import read_json_config  # heavy: deepspeed
        read_json_config(student.deepspeed_config, "student.deepspeed_config")


def build_student(model_path: str, student: StudentConfig, optim: OptimConfig,
                  world: World) -> StudentEngine:
    """The student engine `student.backend` names, loaded from `model_path` (model.student)."""
    if student.backend == "deepspeed":
        from opd.backends.deepspeed import DeepSpeedStudent  # heavy: deepspeed; and a cycle
        return DeepSpeedStudent(model_path, student, optim, world)
    from opd.backends.fsdp import FSDPStudent  # cycle: opd.backends.fsdp imports this package
    return FSDPStudent(model_path, student, optim, world)
