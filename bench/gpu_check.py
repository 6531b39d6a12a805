"""GPU checks, one JSON line each; run by bench/gpu_check.sh on a machine with one CUDA GPU.

1. bf16 training step parity: one packed varlen micro-batch of a Qwen3-architecture model
   (0.6B-like width, 4 layers, random weights) through flash-attn varlen against SDPA on the same
   packing: loss and gradient norm relative differences (bf16: expect ~1e-2, not 1e-6).
2. The vLLM engine on the same architecture: greedy turns of 64 prompts agree with the HF engine
   (fraction of identical trajectories; bf16 kernels differ, so ties may flip), the weight
   sync's seconds and the log-prob gap after it.
3. Rollout throughput at batch 64: vLLM against the HF engine, trajectories/s and the ratio.
Written without a GPU to test it on (this project's CI has none); the first GPU run is its test.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time

import torch

from opd.chat import ChatFormat
from opd.config import RolloutConfig
from opd.packing import pack_varlen
from opd.rollout import rollout
from opd.tools import ToolExecutor
from opd.trajectory import AgentTrajectory
from worlds.toolcalc.tasks import generate_tasks, task_record
from worlds.toolcalc.tokenizer import load_tokenizer
from worlds.toolcalc.tools import registry as toolcalc_registry


def qwen3(tokenizer, directory: str, attn: str):
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                                attn_implementation=attn).cuda()


def step_parity(tokenizer, directory: str) -> dict:
    chat = ChatFormat(tokenizer)
    records = [task_record(task) for task in generate_tasks(16, seed=5)]
    trajectories = []
    for record in records:
        ids = chat.prompt_ids(record["messages"], record["tools"])
        answer = chat.encode("The answer is 42.") + [tokenizer.eos_token_id]
        trajectories.append(AgentTrajectory(ids + answer, [False] * len(ids) + [True] * len(answer),
                                            1, 0, False))
    (batch,) = pack_varlen(trajectories, max_tokens=100_000)
    figures = {}
    for attn in ("sdpa", "flash_attention_2"):
        model = qwen3(tokenizer, directory, attn).train()
        # Both read the packing from the restarting position IDs: flash-attn as cu_seqlens,
        # SDPA as a block-diagonal causal mask (transformers' packed-sequence detection).
        logits = model(input_ids=batch.input_ids.cuda(), position_ids=batch.position_ids.cuda(),
                       use_cache=False).logits[0]
        mask = batch.target_mask[0, :-1].cuda()
        loss = torch.nn.functional.cross_entropy(logits[:-1][mask].float(),
                                                 batch.input_ids[0, 1:].cuda()[mask])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        figures[attn] = (float(loss), float(norm))
        del model
        torch.cuda.empty_cache()
    (sdpa_loss, sdpa_norm), (flash_loss, flash_norm) = figures["sdpa"], figures["flash_attention_2"]
    return {"check": "bf16_step_parity", "sdpa_loss": sdpa_loss, "flash_loss": flash_loss,
            "loss_rel_diff": abs(flash_loss - sdpa_loss) / abs(sdpa_loss),
            "grad_norm_rel_diff": abs(flash_norm - sdpa_norm) / abs(sdpa_norm)}


def engines(tokenizer, directory: str) -> list[dict]:
    from opd.sampling.vllm_engine import VLLMEngine

    model = qwen3(tokenizer, directory, "sdpa").eval()
    chat = ChatFormat(tokenizer, generation_config=model.generation_config)
    prompts = [task_record(task) for task in generate_tasks(64, seed=123)]
    engine = VLLMEngine(directory, max_model_len=2048, dtype=torch.bfloat16, seed=0,
                        gpu_memory_utilization=0.4)
    vocab = len(tokenizer)
    lines = []
    with ToolExecutor(toolcalc_registry()) as executor:
        greedy = RolloutConfig(max_turns=3, max_new_tokens=64, max_total_len=2048,
                               batch_size=64, top_k=1)
        hf = rollout(model, chat, executor, prompts, greedy, vocab_size=vocab)
        served = rollout(None, chat, executor, prompts, greedy, vocab_size=vocab, engine=engine)
        same = sum(a.input_ids == b.input_ids for a, b in zip(hf, served)) / len(prompts)
        start = time.perf_counter()
        engine.load_weights(model.named_parameters())
        torch.cuda.synchronize()
        sync_s = time.perf_counter() - start
        ids = served[0].input_ids
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=x).logits[0, :-1].float()
        trained = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)
        gap = (torch.tensor(engine.sequence_logprobs(ids), device="cuda") - trained).abs()
        lines.append({"check": "vllm_engine", "greedy_identical_fraction": same,
                      "sync_s": sync_s, "logprob_gap_mean": float(gap.mean()),
                      "logprob_gap_max": float(gap.max())})
        sampled = RolloutConfig(max_turns=3, max_new_tokens=64, max_total_len=2048,
                                batch_size=64)
        timings = {}
        for name, args in (("hf", (model, None)), ("vllm", (None, engine))):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = rollout(args[0], chat, executor, prompts, sampled, seed=1, vocab_size=vocab,
                          engine=args[1])
            torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - start,
                             sum(sum(t.assistant_mask) for t in out))
        lines.append({"bench": "gpu_rollout", "batch_size": 64, "prompts": len(prompts),
                      "hf_trajectories_per_s": len(prompts) / timings["hf"][0],
                      "vllm_trajectories_per_s": len(prompts) / timings["vllm"][0],
                      "hf_tokens_per_s": timings["hf"][1] / timings["hf"][0],
                      "vllm_tokens_per_s": timings["vllm"][1] / timings["vllm"][0],
                      "ratio": timings["hf"][0] / timings["vllm"][0],
                      "device": torch.cuda.get_device_name()})
    return lines


def main() -> None:
    assert torch.cuda.is_available(), "bench/gpu_check.py needs a CUDA GPU"
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory() as scratch:
        if importlib.util.find_spec("flash_attn") is not None:
            print(json.dumps(step_parity(tokenizer, scratch)), flush=True)
        else:
            print(json.dumps({"check": "bf16_step_parity", "skipped": "flash-attn not installed"}))
        if importlib.util.find_spec("vllm") is not None:
            for line in engines(tokenizer, scratch):
                print(json.dumps(line), flush=True)
        else:
            print(json.dumps({"check": "vllm_engine", "skipped": "vllm not installed"}))


if __name__ == "__main__":
    main()
