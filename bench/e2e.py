"""End-to-end OPD throughput against TRL's GKDTrainer: same student, teacher, prompts, one process.

    python bench/e2e.py [--steps 6] [--prompts-per-step 32] [--new-tokens 48] [--vocab qwen3]

Both sides train fully on-policy (TRL: lmbda=1, beta=0, i.e. forward KL; ours: forward_kl),
temperature 1, one turn per conversation (TRL's GKD is single-turn), the same prompts, batch and
generation budget, AdamW at the same constant learning rate. The models are Llama shapes on
the toolcalc tokenizer (student 64 hidden x 2 layers, teacher 256 x 4), freshly initialised, so
both sides sample to the full budget. `--vocab qwen3` swaps in the real Qwen3 tokenizer and its
151,936-row embedding (the tests' offline build, tests/qwen3_tokenizer.py, cached under
$OPD_CACHE_DIR), the vocabulary users train with; the toolcalc one has 1,024 entries. The first
step of each side is a warm-up; figures are medians over the other steps' wall times (robust to a
machine shared with other work). Prints one JSON line per trainer: optimizer steps/s, target
tokens/s and the ratio to TRL. TRL is a bench-only dependency (`pip install trl`); without it the
TRL line says so and ours still prints.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before torch loads OpenMP: threads that spin while waiting for work steal the cores of other
# ranks and tool workers on a shared host (a CPU step measured 5x slower); sleeping costs little.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]

STUDENT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               intermediate_size=192)
TEACHER = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=768)
LR = 1e-3
VOCABULARIES = ("toolcalc", "qwen3")


def _tokenizer(vocab: str):
    """The tokenizer and embedding rows of one of VOCABULARIES."""
    from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer

    if vocab == "toolcalc":
        tokenizer = load_tokenizer(TOKENIZER_DIR)
        return tokenizer, len(tokenizer)
    # The tests' builder is not a package module: load it by path, as bench/kl.py does.
    spec = importlib.util.spec_from_file_location("qwen3_tokenizer",
                                                  REPO / "tests" / "qwen3_tokenizer.py")
    assert spec is not None and spec.loader is not None
    qwen3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qwen3)
    return qwen3.load_qwen3_tokenizer(), qwen3.QWEN3_VOCAB_SIZE


def build_world(root: Path, prompts: int, vocab: str) -> None:
    import torch

    from opd.data import write_jsonl
    from worlds.toolcalc.models import ModelShape, build_model, save_model
    from worlds.toolcalc.tasks import answer_text, generate_tasks

    torch.manual_seed(0)
    tokenizer, rows = _tokenizer(vocab)
    tokenizer.save_pretrained(root / "tokenizer")
    for name, shape, seed in (("student", STUDENT, 0), ("teacher", TEACHER, 1)):
        save_model(build_model(ModelShape(**shape), tokenizer, seed=seed, vocab_size=rows),
                   tokenizer, root / name)
    records = [{"messages": [{"role": "user", "content": task.question},
                             {"role": "assistant", "content": answer_text(task.answer)}]}
               for task in generate_tasks(prompts, seed=3)]
    write_jsonl(root / "prompts.jsonl", records)


def ours(root: Path, args, backend: str, teacher: str) -> dict:
    from opd.config import load_config
    from opd.dist import init_world
    from opd.inputs import load_inputs
    from opd.plugins import resolve_plugins
    from opd.trainer import start, train_step

    config = load_config(overrides=[
        f"model.student={root / 'student'}", f"model.teacher={root / 'teacher'}",
        f"model.tokenizer={root / 'tokenizer'}", f"data.prompts={root / 'prompts.jsonl'}",
        f"student.backend={backend}", f"teacher.engine={teacher}",
        "rollout.max_turns=1", f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.max_total_len=512", f"rollout.batch_size={args.prompts_per_step}",
        f"train.prompts_per_step={args.prompts_per_step}", "train.micro_batch_tokens=1024",
        f"train.steps={args.steps}", f"optim.lr={LR}", "optim.schedule=constant",
        "optim.grad_clip=0", f"logging.run_dir={root / ('run-' + backend)}",
        "logging.wandb_mode=disabled", "checkpoint.resume=never"])
    run = start(config, resolve_plugins(config), load_inputs(config),
                init_world("cpu", "gloo", args.threads))
    steps = []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        record = train_step(run, step)
        steps.append((time.perf_counter() - started, record["target_tokens"]))
    run.executor.close()
    return figures(steps[1:])


def figures(steps: list[tuple[float, int]]) -> dict:
    """Median step time and median target tokens/s over (seconds, target tokens) per step."""
    return {"steps_per_s": 1 / statistics.median(s for s, _ in steps),
            "target_tokens_per_s": statistics.median(t / s for s, t in steps)}


def trl(root: Path, records: list[dict], args) -> dict | None:
    try:
        import trl as trl_package
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError:
        return None
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    class CountingGKD(GKDTrainer):
        targets = 0

        def compute_loss(self, model, inputs, *rest, **kwargs):
            CountingGKD.targets += int((inputs["labels"][:, 1:] != -100).sum())
            return super().compute_loss(model, inputs, *rest, **kwargs)

    class Clock(TrainerCallback):
        marks: list[tuple[float, int]] = []

        def on_step_end(self, *unused, **kwargs):
            Clock.marks.append((time.perf_counter(), CountingGKD.targets))

    torch.set_num_threads(args.threads)
    # An explicit fingerprint: hashing the table trips over a pyarrow type on some versions.
    dataset = Dataset(InMemoryTable.from_pylist(records), fingerprint="bench-e2e")
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    config = GKDConfig(
        output_dir=str(root / "trl"), per_device_train_batch_size=args.prompts_per_step,
        max_steps=args.steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        lmbda=1.0, beta=0.0, temperature=1.0, max_new_tokens=args.new_tokens, max_length=512,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
        logging_steps=10**6, dataloader_num_workers=0, bf16=False, seed=0)
    trainer = CountingGKD(
        model=AutoModelForCausalLM.from_pretrained(root / "student", dtype=torch.float32),
        teacher_model=AutoModelForCausalLM.from_pretrained(root / "teacher", dtype=torch.float32),
        args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[Clock()])
    trainer.train()
    marks = Clock.marks
    return {"version": trl_package.__version__,
            **figures([(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])])}


TRAINERS = {"trl_gkd": None, "opd_deepspeed_zero_inference": ("deepspeed", "zero_inference"),
            "opd_fsdp_replicated": ("fsdp", "replicated")}


def measure(trainer: str, root: Path, args) -> dict | None:
    """Figures of one trainer, in this (fresh) process."""
    if trainer == "trl_gkd":
        from opd.data import load_jsonl
        return trl(root, load_jsonl(root / "prompts.jsonl"), args)
    return ours(root, args, *TRAINERS[trainer])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--vocab", choices=VOCABULARIES, default="toolcalc")
    parser.add_argument("--measure", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--world", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, Path(args.world), args)))
        return
    common = {"bench": "e2e", "steps": args.steps, "prompts_per_step": args.prompts_per_step,
              "max_new_tokens": args.new_tokens, "threads": args.threads, "vocab": args.vocab}
    with tempfile.TemporaryDirectory() as scratch:
        build_world(Path(scratch), args.prompts_per_step * args.steps, args.vocab)
        baseline = None
        for trainer in TRAINERS:
            # Each trainer in its own process: no state (threads, allocator, hooks) carries over.
            result = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--measure", trainer,
                                     "--world", scratch], capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"{trainer} failed:\n{result.stderr[-4000:]}")
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            if figures is None:
                print(json.dumps({**common, "trainer": trainer, "skipped": "trl is not installed"}))
                continue
            if trainer == "trl_gkd":
                baseline = figures
            elif baseline is not None:
                figures["ratio_steps"] = figures["steps_per_s"] / baseline["steps_per_s"]
                figures["ratio_target_tokens"] = (figures["target_tokens_per_s"]
                                                  / baseline["target_tokens_per_s"])
            print(json.dumps({**common, "trainer": trainer, **figures}), flush=True)


if __name__ == "__main__":
    main()
