"""The teacher's output head alone, read from its checkpoint: what the trainer applies to a
served teacher's hidden states (the `distribution` payload), without loading the teacher.

The server's engine returns the final hidden states after the final norm, so the head is all
that is left: the lm_head weight (and bias, if the model has one), or the input embeddings for a
model that ties them. Only the tensors of the head are read from the safetensors files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from opd.backends import check_model_dir
from opd.errors import ModelFileError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def head_names(model_dir: str) -> tuple[str, str]:
    """The checkpoint names of the head's weight and bias: the output embeddings' own, or the
    input embeddings' when the model ties them (found on a model built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    weight = names[id(head)] + ".weight"
    if head.weight is model.get_input_embeddings().weight:
        weight = names[id(model.get_input_embeddings())] + ".weight"
    return weight, names[id(head)] + ".bias"


def _weight_map(directory: Path, key: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a checkpoint."""
    if (directory / INDEX_FILE).is_file():
        try:
            return dict(json.loads((directory / INDEX_FILE).read_text())["weight_map"])
        except (ValueError, KeyError, TypeError):
            raise ModelFileError(f"{key}: {directory / INDEX_FILE} has no weight_map (a damaged "
                                 "or partly copied model directory?).") from None
    if (directory / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(directory / SINGLE_FILE), framework="pt") as file:
            return {name: SINGLE_FILE for name in file.keys()}  # noqa: SIM118 - not a dict
    raise ModelFileError(f"{key}: {directory} holds no {SINGLE_FILE} or {INDEX_FILE}; the "
                         "served teacher's head is read from safetensors checkpoints only.")


def load_output_head(model_dir: str, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight [V, H] and bias [V] | None, as stored (dtype and all)."""
    from safetensors import safe_open

    directory = check_model_dir(model_dir, key)
    weight_name, bias_name = head_names(model_dir)
    files = _weight_map(directory, key)
    if weight_name not in files:
        raise ModelFileError(f"{key}: {directory} has no tensor {weight_name} (the output head "
                             "the served teacher's hidden states need).")
    tensors: list[torch.Tensor | None] = []
    for name in (weight_name, bias_name):
        if name not in files:
            tensors.append(None)
            continue
        with safe_open(str(directory / files[name]), framework="pt") as file:
            tensors.append(file.get_tensor(name))
    weight, bias = tensors
    assert weight is not None
    return weight, bias


def head_hash(weight_VH: torch.Tensor) -> str:
    """A digest of a head's weight as stored: the server and the trainer agree exactly when
    both read the same head."""
    digest = hashlib.sha256(f"{tuple(weight_VH.shape)} {weight_VH.dtype} ".encode())
    digest.update(weight_VH.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()
