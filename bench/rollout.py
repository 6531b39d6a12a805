"""Rollout throughput: the seed's per-conversation loop against the batched engine.

Both sample the same 64 toolcalc prompts with the same model (the toolcalc student: prepared
weights when `--model` names them, else a freshly initialised one of the same shape) under the
same limits. The baseline is the seed's `collect_trajectory` semantics, verbatim in shape: batch
of one, one `model.generate` call per turn, tools called in-process (cheaper than our sandbox, so
the comparison favours the seed). Prints one JSON line: trajectories/s of each and the ratio.

    python bench/rollout.py [--batch-size 32] [--prompts 64] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from opd.chat import ChatFormat
from opd.rollout import RolloutConfig, rollout
from opd.tool_calls import parse_hermes_tool_calls
from opd.tools import ToolExecutor
from worlds.toolcalc.tools import TOOL_FUNCTIONS
from worlds.toolcalc.tools import registry as toolcalc_registry


def seed_collect_trajectory(model, tokenizer, messages, tools, *, max_turns, max_new_tokens,
                            max_total_len, temperature):
    """The seed's loop (one conversation, one generate call per turn), returning its length."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           tools=tools)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    for turn in range(max_turns):
        inputs = torch.tensor([ids])
        output = model.generate(
            input_ids=inputs, attention_mask=torch.ones_like(inputs),
            max_new_tokens=min(max_new_tokens, max_total_len - len(ids)),
            do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
            repetition_penalty=1.0, num_beams=1, use_cache=True,
            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        new_ids = output[0, len(ids):].tolist()
        if eos in new_ids:
            new_ids = new_ids[:new_ids.index(eos) + 1]
        if not new_ids:
            break
        ids.extend(new_ids)
        if new_ids[-1] != eos:
            break
        calls = [c for c in parse_hermes_tool_calls(tokenizer.decode(new_ids)) if c.error is None]
        if not calls or turn + 1 == max_turns:
            break
        messages = [{"role": "assistant", "content": "<|agent_opd_observation_boundary|>"}]
        for call in calls:
            try:
                result = TOOL_FUNCTIONS[call.name](**call.arguments)
            except Exception as error:  # the seed's tools returned None on failure
                result = {"error": str(error)}
            messages.append({"role": "tool", "content": json.dumps(result)[:2048]})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True, tools=tools)
        observation = tokenizer(rendered.partition("<|agent_opd_observation_boundary|>")[2],
                                add_special_tokens=False)["input_ids"]
        if observation[:1] == [eos]:
            observation = observation[1:]
        if len(ids) + len(observation) >= max_total_len:
            break
        ids.extend(observation)
    return len(ids)


def load_student(model_path: str | None):
    from transformers import AutoModelForCausalLM

    from worlds.toolcalc.models import STUDENT, build_model
    from worlds.toolcalc.tokenizer import load_tokenizer
    if model_path:
        from transformers import AutoTokenizer
        return (AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                AutoTokenizer.from_pretrained(model_path))
    tokenizer = load_tokenizer()
    return build_model(STUDENT, tokenizer, seed=0), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a prepared student directory")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from worlds.toolcalc.tasks import generate_tasks, task_record
    model, tokenizer = load_student(args.model)
    model.eval()
    prompts = [task_record(task) for task in generate_tasks(args.prompts, seed=123)]
    cfg = RolloutConfig(max_turns=3, max_new_tokens=args.max_new_tokens, max_total_len=1024,
                        temperature=1.0, batch_size=args.batch_size)

    torch.manual_seed(0)
    start = time.perf_counter()
    seed_tokens = sum(seed_collect_trajectory(
        model, tokenizer, p["messages"], p["tools"], max_turns=cfg.max_turns,
        max_new_tokens=cfg.max_new_tokens, max_total_len=cfg.max_total_len,
        temperature=cfg.temperature) for p in prompts)
    seed_seconds = time.perf_counter() - start

    chat = ChatFormat(tokenizer, generation_config=model.generation_config)
    with ToolExecutor(toolcalc_registry()) as executor:
        executor.run_batch([[]])  # workers start outside the timed region, as in a trainer
        start = time.perf_counter()
        trajectories = rollout(model, chat, executor, prompts, cfg, seed=0)
        ours_seconds = time.perf_counter() - start
    ours_tokens = sum(len(t.input_ids) for t in trajectories)

    print(json.dumps({
        "bench": "rollout", "prompts": len(prompts), "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens, "model": args.model or "toolcalc-student-init",
        "threads": args.threads,
        "seed_trajectories_per_s": round(len(prompts) / seed_seconds, 3),
        "ours_trajectories_per_s": round(len(prompts) / ours_seconds, 3),
        "seed_tokens": seed_tokens, "ours_tokens": ours_tokens,
        "ratio": round(seed_seconds / ours_seconds, 2),
    }))


if __name__ == "__main__":
    main()
