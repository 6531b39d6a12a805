"""A tiny toolcalc world for trainer tests: tokenizer, student, teacher, datasets, a recipe.

Models are built from a config and saved with `save_pretrained`, so the trainer runs the real
loading code; nothing is downloaded. DeepSpeed configs keep no parameter persistent, so ZeRO-3
really partitions even these tiny layers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

STUDENT_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=64)
# vLLM's CPU attention needs a head size of at least 32 (opd.sampling.vllm.CPU_HEAD_SIZES).
VLLM_STUDENT_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=128)
TEACHER_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128)
ZERO3_UNPERSISTED = {"zero_optimization": {"stage3_param_persistence_threshold": 0,
                                           "stage3_prefetch_bucket_size": 0}}


def build_world(root: Path, *, num_tasks: int = 16, student_shape: dict = STUDENT_SHAPE,
                teacher_shape: dict = TEACHER_SHAPE) -> Path:
    """Write the world under `root`; returns the recipe path."""
    import torch

    from opd.data import write_jsonl
    from worlds.toolcalc.models import ModelShape, build_model, save_model
    from worlds.toolcalc.tasks import generate_tasks, oracle_record, task_record
    from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer

    torch.set_num_threads(1)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    tokenizer.save_pretrained(root / "tokenizer")
    for name, shape, seed in (("student", student_shape, 0), ("teacher", teacher_shape, 1)):
        save_model(build_model(ModelShape(**shape), tokenizer, seed=seed), tokenizer, root / name)
    tasks = generate_tasks(num_tasks, seed=7)
    write_jsonl(root / "prompts.jsonl", [task_record(t) for t in tasks])
    write_jsonl(root / "completions.jsonl", [oracle_record(t) for t in tasks])
    (root / "zero3.json").write_text(json.dumps(ZERO3_UNPERSISTED))
    recipe = {
        "name": "tiny", "seed": 0,
        "model": {"student": str(root / "student"), "teacher": str(root / "teacher"),
                  "tokenizer": str(root / "tokenizer")},
        "data": {"prompts": str(root / "prompts.jsonl"),
                 "completions": str(root / "completions.jsonl"),
                 "eval": str(root / "prompts.jsonl")},
        "rollout": {"max_turns": 2, "max_new_tokens": 12, "max_total_len": 256, "batch_size": 4},
        "tools": {"registry": "worlds.toolcalc.tools:registry", "num_workers": 1,
                  "timeout_s": 5.0},
        "optim": {"lr": 1e-2, "warmup_steps": 1, "schedule": "cosine"},
        "train": {"steps": 2, "prompts_per_step": 4, "micro_batch_tokens": 256},
        "student": {"deepspeed_config": str(root / "zero3.json")},
        "teacher": {"deepspeed_config": str(root / "zero3.json")},
        "logging": {"run_dir": str(root / "run"), "wandb_mode": "disabled", "progress": False},
        "eval": {"before": False, "after": False, "every": 2, "limit": 4,
                 "checker": "worlds.toolcalc.tasks:check_answer"},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


if __name__ == "__main__":
    print(build_world(Path(sys.argv[1])))


def prepare_tiny(build: bool = True):
    """The toolcalc prepare step in its test configuration (seconds, not minutes)."""
    from worlds.toolcalc.prepare import TEST_CONFIG, prepare
    return prepare(TEST_CONFIG, build=build)
