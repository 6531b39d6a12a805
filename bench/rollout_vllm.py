"""Rollout throughput: the vLLM engine against the HF engine, in one run, and the weight sync.

Both engines sample the same toolcalc prompts (multi-turn, tools in the sandbox) from the same
Llama (the toolcalc student's width and depth, but 2 heads of 32: vLLM's CPU attention has no
head size 16; briefly SFT-ed on toolcalc's oracle conversations, so it calls tools), at the
toolcalc vocabulary (1,286) and at Qwen3's (151,936, the tokenizer's 1,286 IDs drawable). vLLM
runs twice: in turn-synchronous rounds (`rollout.vllm_schedule=rounds`) and with per-conversation
scheduling (the default: a conversation's next turn starts as soon as its tools return, tools
run while the engine generates). `--tool-latency-ms` makes every tool call that much slower,
inside the sandbox (an API round trip; toolcalc's own tools take ~1 ms plus the sandbox's fork),
with `--tool-workers` sandbox workers.

Prints one JSON line per vocabulary and latency: trajectories/s and tokens/s of each engine and
schedule, the ratios, and the seconds to stream the weights into vLLM (one optimizer step's
sync, single process). Needs the vllm extra (.ci/vllm.sh):

    .venv-vllm/bin/python -m bench.rollout_vllm [--prompts 64] [--batch-size 32]
                                                [--tool-latency-ms 0,200]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from dataclasses import replace

import torch

from bench.tool_latency import with_latency
from opd.chat import ChatFormat
from opd.rollout import RolloutConfig, rollout
from opd.sampling.vllm_engine import VLLMEngine
from opd.tools import ToolExecutor
from worlds.toolcalc.tasks import generate_tasks, task_record
from worlds.toolcalc.tokenizer import load_tokenizer
from worlds.toolcalc.tools import registry as toolcalc_registry


def train_tool_caller(tokenizer, steps: int):
    """The toolcalc student's width and depth with 2 heads of 32, briefly SFT-ed on oracle
    conversations so that it calls tools and rollouts are multi-turn (a random model never
    writes a well-formed call)."""
    from opd.chat import ChatFormat
    from opd.data import completion_trajectory
    from worlds.toolcalc.models import ModelShape, build_model
    from worlds.toolcalc.sft import sft
    from worlds.toolcalc.tasks import oracle_record

    shape = ModelShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, intermediate_size=192)
    model = build_model(shape, tokenizer, seed=0)
    chat = ChatFormat(tokenizer)
    records = [oracle_record(task) for task in generate_tasks(2000, seed=7)]
    conversations = [completion_trajectory(chat, r["messages"], r["tools"]) for r in records]
    sft(model, conversations, steps=steps, batch_size=16, lr=5e-3, warmup_steps=20, seed=0,
        desc="tool caller SFT", pad_token_id=tokenizer.pad_token_id)
    return model.eval()


def with_vocabulary(model, vocab_size: int, directory: str):
    """`model` with its (tied) embedding grown to `vocab_size` rows, saved for vLLM; the extra
    rows are never drawn (only the tokenizer's IDs are), but every step computes their logits."""
    import copy

    model = copy.deepcopy(model)
    if vocab_size != model.config.vocab_size:
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    model.save_pretrained(directory)
    return model.eval()


def timed_rollout(model, engine, chat, executor, prompts, cfg, vocab_size):
    start = time.perf_counter()
    trajectories = rollout(model, chat, executor, prompts, cfg, seed=0, vocab_size=vocab_size,
                           engine=engine)
    seconds = time.perf_counter() - start
    tokens = sum(sum(t.assistant_mask) for t in trajectories)
    return seconds, tokens, sum(t.turns for t in trajectories) / len(trajectories)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vocab-sizes", default="1286,151936")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--tool-latency-ms", default="0,200",
                        help="comma-separated extra milliseconds per tool call")
    parser.add_argument("--tool-workers", type=int, default=8)
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    chat = ChatFormat(tokenizer)
    prompts = [task_record(task) for task in generate_tasks(args.prompts, seed=123)]
    cfg = RolloutConfig(max_turns=3, max_new_tokens=args.max_new_tokens, max_total_len=1024,
                        batch_size=args.batch_size)
    caller = train_tool_caller(tokenizer, args.sft_steps)
    latencies = [int(ms) for ms in args.tool_latency_ms.split(",")]
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory())
        executors = {ms: stack.enter_context(ToolExecutor(
            with_latency(toolcalc_registry(), ms / 1000), num_workers=args.tool_workers))
            for ms in latencies}
        for executor in executors.values():
            executor.run_batch([[]])  # workers start outside the timed region, as in a trainer
        for vocab_size in map(int, args.vocab_sizes.split(",")):
            directory = f"{scratch}/v{vocab_size}"
            model = with_vocabulary(caller, vocab_size, directory)
            engine = VLLMEngine(directory, max_model_len=cfg.max_total_len, dtype=torch.float32,
                                seed=0)
            drawable = min(len(tokenizer), vocab_size)
            timed_rollout(None, engine, chat, executors[latencies[0]], prompts[:4], cfg,
                          drawable)  # warm-up
            start = time.perf_counter()
            engine.load_weights(model.named_parameters())
            sync_s = time.perf_counter() - start
            for latency_ms, executor in executors.items():
                runs = {name: timed_rollout(model if name == "hf" else None,
                                            None if name == "hf" else engine, chat, executor,
                                            prompts, replace(cfg, vllm_schedule=schedule),
                                            drawable)
                        for name, schedule in (("hf", "rounds"), ("rounds", "rounds"),
                                               ("vllm", "conversation"))}
                (hf_s, hf_tokens, _), (rounds_s, rounds_tokens, _), (vllm_s, vllm_tokens, turns) \
                    = runs["hf"], runs["rounds"], runs["vllm"]
                print(json.dumps({
                    "bench": "rollout_vllm", "vocab_size": vocab_size, "prompts": len(prompts),
                    "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
                    "tool_latency_ms": latency_ms, "tool_workers": args.tool_workers,
                    "threads": torch.get_num_threads(), "mean_assistant_turns": round(turns, 2),
                    "hf_trajectories_per_s": round(len(prompts) / hf_s, 3),
                    "vllm_rounds_trajectories_per_s": round(len(prompts) / rounds_s, 3),
                    "vllm_trajectories_per_s": round(len(prompts) / vllm_s, 3),
                    "hf_tokens_per_s": round(hf_tokens / hf_s, 1),
                    "vllm_rounds_tokens_per_s": round(rounds_tokens / rounds_s, 1),
                    "vllm_tokens_per_s": round(vllm_tokens / vllm_s, 1),
                    "ratio": round(hf_s / vllm_s, 2),
                    "per_conversation_vs_rounds": round(rounds_s / vllm_s, 2),
                    "sync_s": round(sync_s, 4),
                }), flush=True)
            del engine


if __name__ == "__main__":
    main()
