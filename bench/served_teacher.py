"""The served teacher's costs: payload bytes, prefix reuse, and how long the student waits.

One JSON line per figure set, each with its ratio to a baseline measured in the same run.

    python bench/served_teacher.py payload
        (a) bytes per target token of each answer the teacher server sends, encoded by the real
        wire encoder (opd.teachers.wire) for a conversation of --targets target tokens at
        Qwen3's vocabulary (151,936): sampled log-probs, top-k 20 and 64 with the tail mass,
        and, where the wire has the kind, the final hidden states of a 32B teacher (5,120,
        bf16); the baselines are the full logits [T, V] as raw fp32 and bf16 arrays (what a
        teacher that ships logits sends; no wire kind of ours carries them).

    .venv-vllm/bin/python bench/served_teacher.py prefix
        (c) prefix reuse with the real vLLM engine (CPU): a group of --group samples of one
        prompt (a toolcalc prompt, and one grown to a BFCL-sized system prompt of tool docs),
        scored for prompt log-probs (a) as the server does today (vLLM skips reading its prefix
        cache for any request with prompt log-probs) and (b) with `skip_reading_prefix_cache=
        False`, which vLLM allows: the cached rows of the answer are then left unfilled, so the
        reuse is exact only where the cached prefix ends at or before the first target
        position. Reports tokens computed / tokens scored for both, the ideal (unique tokens of
        the group's prefix tree / tokens scored: what SGLang's radix cache with
        `logprob_start_len` at the first target gives), and the largest difference between
        (a)'s and (b)'s target log-probs.

    .venv-vllm/bin/python bench/served_teacher.py wait
        (b) the share of step time the student waits for its teacher: the same tiny ZeRO-3 world
        (2 CPU ranks, sampled-token loss, the same steps), once with the in-process teacher
        (ZeRO-Inference: `teacher_s`, the scoring inside the step) and once with the teacher
        behind a vLLM server with scoring overlapping the rollout (`teacher_collect_s`: the wait
        for the last answers after the rollout) and once without overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
QWEN3_VOCAB = 151_936
QWEN3_32B_HIDDEN = 5_120


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# -- (a) payload bytes ---------------------------------------------------------------------------

def payload(targets: int) -> None:
    from opd.teachers import wire

    rng = np.random.default_rng(0)
    logits_fp32 = rng.standard_normal((targets, QWEN3_VOCAB), dtype=np.float32)
    baseline_fp32 = len(logits_fp32.tobytes()) / targets
    baseline_bf16 = len(logits_fp32.astype(np.float16).tobytes()) / targets  # 2 bytes a value
    del logits_fp32
    answers: dict[str, wire.ScoreAnswer] = {
        "sampled": wire.ScoreAnswer("sampled", 0, rng.standard_normal(targets, np.float32))}
    for k in (20, 64):
        answers[f"topk{k}"] = wire.ScoreAnswer(
            "topk", k, rng.standard_normal(targets, np.float32),
            topk_ids_TK=rng.integers(0, QWEN3_VOCAB, (targets, k)).astype(np.int32),
            topk_logprobs_TK=rng.standard_normal((targets, k), np.float32),
            topk_rest_T=rng.standard_normal(targets, np.float32))
    if "distribution" in wire.KINDS:  # the hidden-state payload (where this checkout has it)
        bits = rng.integers(0, 2 ** 16, (targets, QWEN3_32B_HIDDEN)).astype(np.uint16)
        answers["hidden_bf16_32b"] = wire.ScoreAnswer(  # type: ignore[call-arg]
            "distribution", 0, np.zeros(0, np.float32), hidden_TH=bits,
            hidden_dtype="bfloat16")
    for name, answer in answers.items():
        body = wire.encode_answer(answer)
        assert wire.decode_answer(body).kind == answer.kind  # what the trainer reads back
        per_token = len(body) / targets
        emit({"bench": "served_teacher_payload", "payload": name, "vocab": QWEN3_VOCAB,
              "targets": targets, "answer_bytes": len(body),
              "bytes_per_target_token": round(per_token, 2),
              "ratio_to_fp32_logits": round(per_token / baseline_fp32, 6),
              "ratio_to_bf16_logits": round(per_token / baseline_bf16, 6),
              "times_smaller_than_bf16_logits": round(baseline_bf16 / per_token, 1),
              "fp32_logits_bytes_per_token": baseline_fp32,
              "bf16_logits_bytes_per_token": baseline_bf16})
    if "distribution" not in wire.KINDS:
        emit({"bench": "served_teacher_payload", "payload": "hidden_bf16_32b",
              "note": "this checkout's wire has no hidden-state kind; not measured"})


# -- (c) prefix reuse ----------------------------------------------------------------------------

def _tiny_teacher(root: Path):
    """A tiny Llama for the toolcalc tokenizer (head size 32, which vLLM's CPU attention
    serves), saved with its tokenizer; and the chat format."""
    from opd.chat import ChatFormat
    from worlds.toolcalc.models import ModelShape, build_model, save_model
    from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    shape = ModelShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=128)
    save_model(build_model(shape, tokenizer, seed=1), tokenizer, root / "teacher")
    return root / "teacher", ChatFormat(tokenizer)


def _prompts(chat) -> dict[str, list[int]]:
    """A toolcalc prompt, and the same question behind a long system prompt of tool docs (many
    renamed copies of toolcalc's tools), about as long as BFCL's system-plus-function-docs."""
    from worlds.toolcalc.tasks import generate_tasks, task_record

    record = task_record(generate_tasks(1, seed=7)[0])
    many_tools = [{**tool, "function": {**tool["function"],
                                        "name": f"{tool['function']['name']}_{copy}"}}
                  for copy in range(40) for tool in record["tools"]]
    return {"toolcalc": chat.prompt_ids(record["messages"], record["tools"]),
            "bfcl_sized": chat.prompt_ids(record["messages"], many_tools)}


def _unique_tokens(sequences: list[list[int]]) -> int:
    """Nodes of the group's prefix tree: each distinct (prefix) computed once."""
    seen: set[tuple[int, ...]] = set()
    for ids in sequences:
        for end in range(1, len(ids) + 1):
            seen.add(tuple(ids[:end]))
    return len(seen)


def prefix(group: int, new_tokens: int) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as scratch:
        model, chat = _tiny_teacher(Path(scratch))
        prompts = _prompts(chat)
        longest = max(len(ids) for ids in prompts.values()) + new_tokens + 8
        llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", seed=0,
                  max_model_len=longest, max_logprobs=0, enable_prefix_caching=True,
                  enforce_eager=True, gpu_memory_utilization=0.3)
        for name, prompt_ids in prompts.items():
            # The group: `group` samples of the prompt, as rollout.samples_per_prompt draws them.
            sampled = llm.generate(
                [TokensPrompt(prompt_token_ids=prompt_ids)],
                SamplingParams(n=group, max_tokens=new_tokens, min_tokens=new_tokens,
                               temperature=1.0, seed=3, detokenize=False), use_tqdm=False)[0]
            conversations = [prompt_ids + list(c.token_ids) for c in sampled.outputs]
            first_target = len(prompt_ids) - 1  # the position that predicts the first sample
            llm.generate([TokensPrompt(prompt_token_ids=conversations[0])],  # warm-up, untimed
                         SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            scored = sum(len(ids) for ids in conversations)
            results = {}
            for mode, skip in (("vllm_default", None), ("read_prefix_cache", False)):
                llm.reset_prefix_cache()
                params = SamplingParams(max_tokens=1, detokenize=False, flat_logprobs=True,
                                        prompt_logprobs=0, skip_reading_prefix_cache=skip)
                started = time.perf_counter()
                # As conversations finish at different times (overlap): one, then the rest.
                outputs = []
                for batch in (conversations[:1], conversations[1:]):
                    outputs += llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch],
                                            params, use_tqdm=False)
                seconds = time.perf_counter() - started
                cached = [output.num_cached_tokens or 0 for output in outputs]
                values = [np.asarray(o.prompt_logprobs.logprobs, np.float64)[
                    np.asarray(o.prompt_logprobs.start_indices)[first_target + 1:]]
                    for o in outputs]
                results[mode] = {"cached": cached, "values": values, "seconds": seconds}
            exact = all(c <= first_target for c in results["read_prefix_cache"]["cached"])
            difference = max(float(np.abs(a - b).max()) for a, b in zip(
                results["vllm_default"]["values"], results["read_prefix_cache"]["values"]))
            computed = {mode: scored - sum(r["cached"]) for mode, r in results.items()}
            unique = _unique_tokens(conversations)
            emit({"bench": "served_teacher_prefix", "prompt": name, "group": group,
                  "prompt_tokens": len(prompt_ids), "sampled_tokens": new_tokens,
                  "tokens_scored": scored, "unique_tokens_ideal": unique,
                  "ideal_unique_over_scored": round(unique / scored, 4),
                  "computed_over_scored_vllm_default": round(
                      computed["vllm_default"] / scored, 4),
                  "computed_over_scored_read_prefix_cache": round(
                      computed["read_prefix_cache"] / scored, 4),
                  "cached_tokens_read_prefix_cache": results["read_prefix_cache"]["cached"],
                  "cached_prefix_ends_before_first_target": exact,
                  "max_abs_target_logprob_difference": difference,
                  "seconds_vllm_default": round(results["vllm_default"]["seconds"], 4),
                  "seconds_read_prefix_cache": round(
                      results["read_prefix_cache"]["seconds"], 4),
                  "time_ratio_read_to_default": round(
                      results["read_prefix_cache"]["seconds"]
                      / results["vllm_default"]["seconds"], 4)})


# -- (b) the student's wait -------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train(recipe: Path, run_dir: Path, steps: int, *overrides: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_free_port()), "launch/train.py", "--recipe", str(recipe),
               f"logging.run_dir={run_dir}", f"train.steps={steps}", "eval.every=0",
               "checkpoint.every=0", "loss.direction=sampled_reverse_kl", *overrides]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    if finished.returncode:
        sys.exit(f"{run_dir.name} failed:\n{finished.stderr[-4000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait(steps: int, prompts_per_step: int, samples: int) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from dist_scripts.world import VLLM_STUDENT_SHAPE, build_world

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        recipe = build_world(root / "world", student_shape=VLLM_STUDENT_SHAPE,
                             teacher_shape=VLLM_STUDENT_SHAPE)
        port = _free_port()
        started = subprocess.run(
            ["bash", "launch/teacher_server.sh", "--model", str(root / "world" / "teacher"),
             "--tokenizer", str(root / "world" / "tokenizer"), "--port", str(port),
             "--max-model-len", "512", "--dtype", "float32", "--gpu-memory-utilization", "0.3"],
            cwd=REPO, capture_output=True, text=True,
            env={**os.environ, "OPD_TEACHER_PYTHON": sys.executable,
                 "VLLM_CPU_KVCACHE_SPACE": "1", "OPD_TEACHER_LOG": str(root / "server.log")})
        if started.returncode:
            sys.exit(started.stderr)
        pid = int(re.search(r"pid (\d+)", started.stdout).group(1))
        work = [f"train.prompts_per_step={prompts_per_step}",
                f"rollout.samples_per_prompt={samples}"]
        served = ["teacher.engine=served", f"teacher.urls=[http://127.0.0.1:{port}]"]
        try:
            runs = {"in_process": (_train(recipe, root / "in_process", steps, *work,
                                          "teacher.signal=sampled"), "teacher_s"),
                    "served_overlap": (_train(recipe, root / "overlap", steps, *work, *served,
                                              "teacher.overlap=true"), "teacher_collect_s"),
                    "served_after_rollout": (_train(recipe, root / "after", steps, *work,
                                                    *served, "teacher.overlap=false"),
                                             "teacher_collect_s")}
        finally:
            os.kill(pid, 9)
    # The first step loads and compiles: left out.
    shares = {name: statistics.median(r[key] / r["step_s"] for r in records[1:])
              for name, (records, key) in runs.items()}
    for name, (records, key) in runs.items():
        emit({"bench": "served_teacher_wait", "teacher": name, "steps": steps,
              "conversations_per_step": records[-1]["conversations"],
              "wait_key": key, "median_wait_s": round(statistics.median(
                  r[key] for r in records[1:]), 4),
              "median_step_s": round(statistics.median(r["step_s"] for r in records[1:]), 4),
              "median_wait_share": round(shares[name], 4),
              "share_ratio_to_in_process": round(shares[name] / shares["in_process"], 4),
              "loss_last": records[-1]["loss"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("payload", "prefix", "wait"))
    parser.add_argument("--targets", type=int, default=512, help="payload: target tokens")
    parser.add_argument("--group", type=int, default=8, help="prefix: samples of one prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="prefix: tokens a sample")
    parser.add_argument("--steps", type=int, default=4, help="wait: optimizer steps a run")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2, help="wait: samples per prompt")
    args = parser.parse_args()
    if args.what == "payload":
        payload(args.targets)
    elif args.what == "prefix":
        prefix(args.group, args.new_tokens)
    else:
        wait(args.steps, args.prompts_per_step, args.samples)


if __name__ == "__main__":
    main()
