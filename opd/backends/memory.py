"""Per-rank memory of the student's and the teacher's model states, for `--dry-run`.

Sizes come from each model's config, built on the meta device: nothing is loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from opd.backends import decoder_layers, resolve_precision


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
    shard_bytes = compute if backend == "deepspeed" else 4
    states = {"params": parameters * shard_bytes / world_size,
              "grads": parameters * shard_bytes / world_size,
              "optimizer": parameters * (8 + master) / world_size}
    working = 2 * largest_layer * compute
    offloaded = states["optimizer"] + states["grads"] if offload_optimizer == "cpu" else 0.0
    return {**states, "device": states["params"] + states["grads"] + states["optimizer"]
            - offloaded + working, "host": offloaded,
            "gather_once": parameters * compute}


def _missing(role: str, path: str) -> str:
    return f"{role}: {path} not found (the recipe's prepare step has not built it yet)"


def memory_estimate(config, world_size: int, device: str) -> list[str]:
    """Lines of per-rank model-state memory for the student and the teacher (dry run)."""
    def bf16(precision: str) -> bool:
        return resolve_precision(precision, "sdpa", torch.device(device)).dtype == torch.bfloat16

    lines = []
    student = _count(config.model.student)
    if student is None:
        lines.append(_missing("student", config.model.student))
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
        lines.append(_missing("teacher", config.model.teacher))
    else:
        n, largest = teacher
        b = 2 if bf16(config.teacher.precision) else 4
        engine = config.teacher.engine
        share = n * b if engine == "replicated" else n * b / world_size
        where = {"cpu": "host", "nvme": "NVMe"}.get(config.teacher.offload_param, "device")
        lines.append(f"teacher: {n / 1e6:.1f}M parameters, {engine}: {_size(share)} per rank on "
                     f"{where}, + {_size(largest * b)} for the largest gathered layer or lm_head")
    return lines
