"""The teacher's own conversations on a recipe's prompts, as a dataset to train on off-policy.

What SFT, token-level KD and the GKD mix train on when a distiller has prompts, environments and
a teacher but no demonstrations (the quality study's baselines, bench/quality.py): the teacher
samples each prompt's whole episode with the recipe's tools, sandbox, chat template and rollout
settings, and each finished conversation becomes a dataset line (its `messages` with the
assistant turns as sampled and the tool results as returned), ready for `data.completions`:

    python -m opd.teacher_data --recipe recipes/toolcalc_confirm.yaml --out teacher.jsonl
    deepspeed launch/train.py --recipe recipes/toolcalc_confirm.yaml \\
        data.completions=teacher.jsonl loss.off_policy_fraction=1.0 loss.direction=sft

A conversation is kept only when it renders back through the chat template
(`opd.data.completion_trajectory`, what a training run does with the line) to the text the
teacher sampled, so no turn, tool result or boundary is lost; truncated ones are dropped. Where
the teacher sampled a word split into tokens the tokenizer would not produce ("Thist" + "orra"
for "Th" + "i" + "s" + "tor" + "ra"), the text survives but those tokens cannot: the line trains
on the tokenizer's own split, as any text dataset does, and is counted as `retokenized`.
`--successful-only` also drops episodes the eval would not count as a success (rejection
sampling); by default failed episodes stay, so the data is what the teacher does.
The counts go to the output's `.json` beside it. One process on one device (cuda when
available): for a teacher too large for one device, serve it and sample with your server.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from opd.errors import ConfigError, DatasetError, OPDError

# What the hermes and Qwen chat templates put around each tool result in an observation turn.
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def conversation_messages(chat, prompt: dict, trajectory) -> list[dict]:
    """A sampled trajectory as chat messages: each assistant turn's text as sampled (before its
    stop token), each observation's `<tool_response>` contents as tool messages, and the
    record's further user turns where the rollout appended them."""
    from opd.data import prompt_record, user_turns

    tokenizer = chat.tokenizer
    messages = list(prompt_record(prompt)["messages"])
    further_users = iter(user_turns(prompt))
    for start, end, kind in trajectory.spans:
        ids = trajectory.input_ids[start:end]
        if kind == "assistant":
            if ids and ids[-1] in chat.stop_token_ids:
                ids = ids[:-1]
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(ids, skip_special_tokens=False)})
        elif kind == "observation":
            text = tokenizer.decode(ids, skip_special_tokens=False)
            messages += [{"role": "tool", "content": content}
                         for content in TOOL_RESPONSE.findall(text)]
        elif kind == "user":
            messages.append(next(further_users))
    return messages


def rendered_back(chat, prompt: dict, trajectory) -> tuple[list[dict] | None, str]:
    """A sampled trajectory's messages and how they render back through the template: "exact"
    (the same token IDs), "retokenized" (the same text in the tokenizer's own split of some
    word the teacher sampled in pieces) or, with no messages, "not_rendered_back"."""
    from opd.data import completion_trajectory

    messages = conversation_messages(chat, prompt, trajectory)
    try:
        rendered = completion_trajectory(chat, messages, prompt.get("tools"),
                                         prompt.get("tools_by_turn")).input_ids
    except DatasetError:  # e.g. an observation whose tool results were not found in it
        return None, "not_rendered_back"
    if rendered == trajectory.input_ids:
        return messages, "exact"
    decode = chat.tokenizer.decode
    if decode(rendered, skip_special_tokens=False) == \
            decode(trajectory.input_ids, skip_special_tokens=False):
        return messages, "retokenized"
    return None, "not_rendered_back"


def sample_teacher_data(config, plugins, out: Path, seed: int, *, device=None,
                        successful_only: bool = False) -> dict:
    """Sample the teacher on `config.data.prompts`, write the kept conversations to `out`
    (JSONL) and the counts to `out` with suffix .json; returns the counts. An OPDError where no
    conversation is kept."""
    from opd.data import write_jsonl
    from opd.eval import episode_reward, load_model, tool_executor
    from opd.inputs import chat_format, load_prompts
    from opd.rollout import rollout

    check = plugins.checker
    started = time.perf_counter()
    chat = chat_format(config.tokenizer_path, config.model, config.model.teacher, "model.teacher")
    prompts = load_prompts(config.data.prompts, chat, config.rollout.max_total_len,
                           "data.prompts")
    model = load_model(config.model.teacher, device, "model.teacher")
    with tool_executor(plugins.tool_registry, config.tools, plugins.environment) as executor:
        trajectories = rollout(model, chat, executor, prompts, config.rollout, seed=seed,
                               parser=plugins.parser)
    kept: list[dict] = []
    counts: dict = {"prompts": len(prompts), "truncated": 0, "not_rendered_back": 0,
                    "retokenized": 0, "successful": 0, "unsuccessful_dropped": 0,
                    "with_failed_or_invalid_calls": 0}
    for prompt, trajectory in zip(prompts, trajectories):
        if trajectory.truncated:
            counts["truncated"] += 1
            continue
        messages, rendering = rendered_back(chat, prompt, trajectory)
        if messages is None:
            counts["not_rendered_back"] += 1
            continue
        counts["retokenized"] += rendering == "retokenized"
        successful = check is not None and \
            episode_reward(prompt, trajectory, chat.tokenizer, check) > 0
        counts["successful"] += successful
        if successful_only and not successful:
            counts["unsuccessful_dropped"] += 1
            continue
        counts["with_failed_or_invalid_calls"] += \
            trajectory.counts.failed + trajectory.counts.invalid > 0
        kept.append(dict(prompt, messages=messages))
    if check is None:  # not measured
        counts["successful"] = None
    counts.update(kept=len(kept), temperature=config.rollout.temperature, seed=seed,
                  teacher=str(config.model.teacher), prompts_file=str(config.data.prompts),
                  seconds=round(time.perf_counter() - started, 1))
    if not kept:
        raise OPDError(f"none of the teacher's {len(prompts)} conversations on data.prompts "
                       f"was kept ({json.dumps(counts)}); nothing was written to {out}.")
    write_jsonl(out, kept)
    out.with_suffix(".json").write_text(json.dumps(counts, indent=2) + "\n")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True,
                        help="the teacher, prompts, tools and rollout settings come from it")
    parser.add_argument("--out", required=True, help="the JSONL to write (not overwritten)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: the recipe's)")
    parser.add_argument("--successful-only", action="store_true",
                        help="keep only episodes the eval counts as a success")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="recipe overrides (e.g. rollout.temperature=0.7)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from opd.config import load_config
    from opd.plugins import prepared, resolve_plugins

    args = parse_args(argv)
    out = Path(args.out)
    try:
        if out.suffix == ".json":
            raise ConfigError(f"--out {out}: the conversations are JSONL and their counts go to "
                              "the same name ending in .json; name a .jsonl file.")
        if out.exists():
            raise ConfigError(f"--out {out} exists; remove it or name another file (nothing "
                              "was sampled).")
        if not out.parent.is_dir():
            raise ConfigError(f"--out {out}: its directory {out.parent} does not exist.")
        config = load_config(args.recipe, None, args.overrides)
        plugins = resolve_plugins(config)
        # Before the world is prepared, which can take minutes.
        if not config.model.teacher:
            raise ConfigError(f"{args.recipe}: model.teacher is empty; the teacher's "
                              "conversations need a teacher model directory.")
        if args.successful_only and plugins.checker is None:
            raise ConfigError("--successful-only needs eval.checker (module:function("
                              "final_text, record) -> bool) to tell a success; the recipe "
                              "names none.")
        config = prepared(config, plugins)
        counts = sample_teacher_data(config, plugins, out,
                                     config.seed if args.seed is None else args.seed,
                                     device=args.device, successful_only=args.successful_only)
    except OPDError as error:
        sys.exit(f"error: {error}")
    print(json.dumps({"teacher_data": str(out), **counts}))
    return counts


if __name__ == "__main__":
    main()
