"""Rollout throughput: the vLLM engine against the HF engine, in one run, and the weight sync.

Both engines sample the same toolcalc prompts (multi-turn, tools in the sandbox) from the same
randomly initialised Llama (the toolcalc student's width and depth, but 2 heads of 32: vLLM's CPU
attention has no head size 16), at the toolcalc vocabulary (1,286) and at Qwen3's (151,936, the
tokenizer's 1,286 IDs drawable). Prints one JSON line per vocabulary: trajectories/s and tokens/s
of each engine, their ratio, and the seconds to stream the weights into vLLM (one optimizer
step's sync, single process). Needs the vllm extra (.ci/vllm.sh):

    .venv-vllm/bin/python -m bench.rollout_vllm [--prompts 64] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from opd.chat import ChatFormat
from opd.rollout import RolloutConfig, rollout
from opd.tools import ToolExecutor
from opd.vllm_engine import VLLMEngine
from worlds.toolcalc.tasks import generate_tasks, task_record
from worlds.toolcalc.tokenizer import load_tokenizer
from worlds.toolcalc.tools import registry as toolcalc_registry


def build_student(tokenizer, vocab_size: int, directory: str):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=192,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    return model


def timed_rollout(model, engine, chat, executor, prompts, cfg, vocab_size):
    start = time.perf_counter()
    trajectories = rollout(model, chat, executor, prompts, cfg, seed=0, vocab_size=vocab_size,
                           engine=engine)
    seconds = time.perf_counter() - start
    tokens = sum(sum(t.assistant_mask) for t in trajectories)
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vocab-sizes", default="1286,151936")
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    chat = ChatFormat(tokenizer)
    prompts = [task_record(task) for task in generate_tasks(args.prompts, seed=123)]
    cfg = RolloutConfig(max_turns=3, max_new_tokens=args.max_new_tokens, max_total_len=1024,
                        batch_size=args.batch_size)
    with ToolExecutor(toolcalc_registry()) as executor, tempfile.TemporaryDirectory() as scratch:
        executor.run_batch([[]])  # workers start outside the timed region, as in a trainer
        for vocab_size in map(int, args.vocab_sizes.split(",")):
            directory = f"{scratch}/v{vocab_size}"
            model = build_student(tokenizer, vocab_size, directory)
            engine = VLLMEngine(directory, max_model_len=cfg.max_total_len, dtype=torch.float32,
                                seed=0)
            drawable = min(len(tokenizer), vocab_size)
            timed_rollout(None, engine, chat, executor, prompts[:4], cfg, drawable)  # warm-up
            hf_s, hf_tokens = timed_rollout(model, None, chat, executor, prompts, cfg, drawable)
            vllm_s, vllm_tokens = timed_rollout(None, engine, chat, executor, prompts, cfg,
                                                drawable)
            start = time.perf_counter()
            engine.load_weights(model.named_parameters())
            sync_s = time.perf_counter() - start
            print(json.dumps({
                "bench": "rollout_vllm", "vocab_size": vocab_size, "prompts": len(prompts),
                "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
                "threads": torch.get_num_threads(),
                "hf_trajectories_per_s": round(len(prompts) / hf_s, 3),
                "vllm_trajectories_per_s": round(len(prompts) / vllm_s, 3),
                "hf_tokens_per_s": round(hf_tokens / hf_s, 1),
                "vllm_tokens_per_s": round(vllm_tokens / vllm_s, 1),
                "ratio": round(hf_s / vllm_s, 2), "sync_s": round(sync_s, 4),
            }), flush=True)
            del engine


if __name__ == "__main__":
    main()
