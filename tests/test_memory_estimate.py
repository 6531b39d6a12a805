"""The dry-run memory estimate of the Qwen3 recipes equals the hand formula of
opd/backends/memory.py (worked through in docs/qwen3.md), from published config.json values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd.backends.memory import memory_estimate
from opd.config import load_config

REPO = Path(__file__).resolve().parents[1]
GiB, MiB = 2**30, 2**20

# Qwen/Qwen3-*/config.json: hidden, layers, heads, kv heads, intermediate, tied embeddings.
QWEN3 = {"Qwen3-1.7B": (2048, 28, 16, 8, 6144, True), "Qwen3-4B": (2560, 36, 32, 8, 9728, True),
         "Qwen3-8B": (4096, 36, 32, 8, 12288, False),
         "Qwen3-32B": (5120, 64, 64, 8, 25600, False)}
V, HEAD_DIM = 151936, 128


def config_only(root: Path, name: str) -> Path:
    hidden, layers, heads, kv_heads, intermediate, tied = QWEN3[name]
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": HEAD_DIM, "intermediate_size": intermediate,
        "tie_word_embeddings": tied, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}))
    return root / name


def by_hand(name: str) -> dict:
    """Parameter count and shapes, from the published sizes alone."""
    h, layers, heads, kv_heads, i, tied = QWEN3[name]
    q, kv = heads * HEAD_DIM, kv_heads * HEAD_DIM
    layer = h * q + 2 * h * kv + q * h + 2 * HEAD_DIM + 3 * h * i + 2 * h
    n = V * h + layers * layer + h + (0 if tied else V * h)
    return dict(n=n, h=h, layers=layers, largest=max(layer, V * h), kv_heads=kv_heads,
                act=2 * (4 * h + 2 * q + 2 * kv + 3 * i), kv=kv)


def size(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.3g} GiB" if num_bytes >= GiB else f"{num_bytes / MiB:.3g} MiB"


@pytest.mark.parametrize("recipe, cluster, student, teacher, ranks, per_node", [
    ("qwen3_8b_to_1.7b", "qwen3-8xh100", "Qwen3-1.7B", "Qwen3-8B", 8, 8),
    ("qwen3_32b_to_4b", "qwen3-4x8xh100", "Qwen3-4B", "Qwen3-32B", 32, 8),
])
def test_recipe_dry_run_equals_the_hand_formula(tmp_path, recipe, cluster, student, teacher,
                                                ranks, per_node):
    config = load_config(REPO / "recipes" / f"{recipe}.yaml",
                         REPO / "configs" / "clusters" / f"{cluster}.yaml",
                         [f"model.student={config_only(tmp_path, student)}",
                          f"model.teacher={config_only(tmp_path, teacher)}"])
    # AutoTP shards the teacher over one node's ranks (teacher.tp_size 0); each node a copy.
    lines = memory_estimate(config, ranks, "cuda", config.teacher.tp_size or per_node)
    s, t = by_hand(student), by_hand(teacher)
    n, w, tokens = s["n"], ranks, config.train.micro_batch_tokens
    assert config.student.precision == "bf16" and config.student.gradient_checkpointing

    # Model states: bf16 params + bf16 grads + fp32 master and Adam moments, over the ranks, and
    # two gathered bf16 layers.
    states = 16 * n / w + 2 * 2 * s["largest"]
    assert lines[0] == f"student: {n / 1e6:.1f}M parameters, deepspeed sharded over {w} ranks, bf16"
    assert lines[1] == (f"  optimizer offload none (chosen): params {size(2 * n / w)} + grads "
                        f"{size(2 * n / w)} + Adam {size(12 * n / w)} -> device {size(states)}, "
                        "host 0 B per rank")
    # Gradient checkpointing: the layer inputs, plus one layer's intermediates.
    activations = tokens * (s["layers"] * s["h"] * 2 + s["act"])
    chunk = 128  # max(128, 12,582,912 // 151,936)
    loss, head_grad = 3 * chunk * V * 4, V * s["h"] * 4
    assert lines[3] == (f"  one micro-batch of {tokens} tokens: activations {size(activations)} "
                        f"(gradient checkpointing on) + loss {size(loss)} ([{chunk}, {V}] fp32 "
                        f"buffers) + lm_head fp32 gradient {size(head_grad)}")
    batch, length = config.rollout.batch_size, config.rollout.max_total_len
    kv_cache = batch * length * s["layers"] * 2 * s["kv"] * 2
    assert lines[4].startswith(f"  rollout gather-once holds the whole student: +{size(2 * n)} "
                               f"on device, + KV cache {size(kv_cache)} ({batch} x {length} tokens)")

    engine = config.teacher.engine
    share = {"zero_inference": 2 * t["n"] / w,  # AutoTP keeps the input embedding whole
             "tensor_parallel": 2 * (t["n"] - V * t["h"]) / per_node + 2 * V * t["h"]}[engine]
    teacher_activations = tokens * t["act"]
    assert lines[5] == (f"teacher: {t['n'] / 1e6:.1f}M parameters, {engine}: {size(share)} per "
                        f"rank on device, + {size(2 * t['largest'])} for the largest gathered "
                        f"layer or lm_head, + activations {size(teacher_activations)} (one layer, "
                        f"{tokens} tokens, no grad)")
    training = states + activations + loss + head_grad + share + 2 * t["largest"] \
        + teacher_activations
    rollout = states + 2 * n + kv_cache + share
    assert lines[-1] == f"device peak per rank: training {size(training)}, rollout {size(rollout)}"
    uneven = engine == "tensor_parallel" and per_node > t["kv_heads"]
    assert uneven == any("AutoTP splits attention" in x for x in lines)
