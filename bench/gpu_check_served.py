"""The served teacher on one CUDA GPU, one JSON line per run; run by bench/gpu_check_served.sh.

A vLLM teacher server (python -m opd.teachers.server, started by launch/teacher_server.sh) and
the trainer share the GPU: the server takes --gpu-memory-utilization 0.3, the trainer the rest.
The models are Llama decoders on the toolcalc tokenizer built from a config (teacher 1024 wide
x 8 layers, student 256 x 4; tests/dist_scripts/world.py writes them with the recipe), so
nothing is downloaded. Three short trainings of a ZeRO-3 student at equal work (same prompts,
steps and seed), each printing target tokens/s (median over the steps after the first), the
share of step time spent waiting for the teacher ((teacher_s + teacher_collect_s) / step_s) and
the teacher answer's bytes per target token (the wire's own encoder, opd.teachers.wire):

  served_topk       teacher.engine=served, forward_kl over the top 64 plus the rest's mass
  served_sampled    teacher.engine=served, the sampled-token estimator (sampled_reverse_kl)
  in_process_topk   teacher.engine=replicated (the teacher beside the student), the same top 64

Written without a GPU to test it on; the first GPU run is its test. Under 8 minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
STUDENT = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=704)
TEACHER = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
               num_key_value_heads=8, intermediate_size=2816)
STEPS, TOP_K = 6, 64
COMMON = [f"train.steps={STEPS}", "train.prompts_per_step=32", "rollout.batch_size=32",
          "rollout.max_new_tokens=48", "checkpoint.every=0", "eval.before=false",
          "eval.after=false", "eval.every=0", "optim.schedule=constant", "optim.warmup_steps=0",
          "cluster.device=cuda", "cluster.dist_backend=nccl", "student.precision=bf16",
          "teacher.precision=bf16"]
RUNS = {
    "served_topk": ["loss.direction=forward_kl", "teacher.signal=topk", f"teacher.top_k={TOP_K}"],
    "served_sampled": ["loss.direction=sampled_reverse_kl"],
    "in_process_topk": ["teacher.engine=replicated", "loss.direction=forward_kl",
                        "teacher.signal=topk", f"teacher.top_k={TOP_K}"],
}


def _build_world(root: Path) -> Path:
    """tests/dist_scripts/world.py's toolcalc world (not a package module: loaded by path)."""
    spec = importlib.util.spec_from_file_location("world", REPO / "tests" / "dist_scripts" /
                                                  "world.py")
    assert spec is not None and spec.loader is not None
    world = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(world)
    return world.build_world(root, num_tasks=64, student_shape=STUDENT, teacher_shape=TEACHER)


def answer_bytes_per_token(kind: str, tokens: int = 1000) -> float:
    from opd.teachers.wire import ScoreAnswer, encode_answer

    k = TOP_K if kind == "topk" else 0
    answer = ScoreAnswer(kind, k, np.zeros(tokens, np.float32))
    if k:
        answer.topk_ids_TK = np.zeros((tokens, k), np.int32)
        answer.topk_logprobs_TK = np.zeros((tokens, k), np.float32)
        answer.topk_rest_T = np.zeros(tokens, np.float32)
    return len(encode_answer(answer)) / tokens


def start_server(root: Path) -> tuple[str, int]:
    started = subprocess.run(
        ["bash", str(REPO / "launch" / "teacher_server.sh"), "--model", str(root / "teacher"),
         "--tokenizer", str(root / "tokenizer"), "--port", "8800", "--max-model-len", "1025",
         "--max-top-k", str(TOP_K), "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OPD_TEACHER_PYTHON": sys.executable,
             "OPD_TEACHER_LOG": str(root / "server.log"), "OPD_TEACHER_WAIT_S": "240"})
    if started.returncode:
        sys.exit(f"the teacher server did not start: {started.stderr.strip()}")
    pid = re.search(r"pid (\d+)", started.stdout)
    assert pid is not None, started.stdout  # launch/teacher_server.sh prints it when ready
    urls = started.stdout.strip().splitlines()[-1].split()[-1]  # teacher.urls=[...]
    return urls.removeprefix("teacher.urls="), int(pid.group(1))


def train(recipe: Path, run_dir: Path, overrides: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
               "--master_port", "29731", str(REPO / "launch" / "train.py"), "--recipe",
               str(recipe), f"logging.run_dir={run_dir}", *COMMON, *overrides]
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as out:
        code = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=180).returncode
    if code:
        sys.exit(f"the {run_dir.name} training failed (exit {code}); the end of its log:\n"
                 + log.read_text()[-3000:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def figures(name: str, records: list[dict]) -> dict:
    later = records[1:] or records  # the first step compiles and warms up
    wait = [(r.get("teacher_s", 0.0) + r.get("teacher_collect_s", 0.0)) / r["step_s"]
            for r in later]
    kind = "sampled" if name == "served_sampled" else "topk"
    return {"bench": "gpu_served_teacher", "run": name, "steps": len(records),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "teacher_wait_share": statistics.median(wait),
            # an in-process teacher's scores never cross a wire
            "answer_bytes_per_target_token": answer_bytes_per_token(kind)
            if name.startswith("served") else None,
            "step_s": statistics.median(r["step_s"] for r in later)}


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu_check_served.py needs a CUDA GPU (torch.cuda.is_available() is "
                 "False): run it on a GPU machine, through bench/gpu_check_served.sh.")
    if importlib.util.find_spec("vllm") is None:
        sys.exit("bench/gpu_check_served.py needs vLLM for the teacher server: "
                 "pip install -r requirements-vllm-gpu.txt (bench/gpu_check_served.sh does).")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        recipe = _build_world(root / "world")
        urls, pid = start_server(root / "world")
        try:
            for name, overrides in RUNS.items():
                served = [] if name.startswith("in_process") else \
                    ["teacher.engine=served", f"teacher.urls={urls}"]
                records = train(recipe, root / name, [*served, *overrides])
                print(json.dumps({**figures(name, records),
                                  "device": torch.cuda.get_device_name()}), flush=True)
        finally:
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
