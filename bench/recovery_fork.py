"""After a refused call, which way does each model go? In the checked chain worlds the teacher
recovers from an environment refusal ("step N of the question is not ...; did you mean ...?
confirm runs it") by calling `confirm`, and from a malformed call by writing the call again.
Right after `<tool_call>` the two part at one token: the generic opening `\\n{"name": "` (a tool
name follows: confirm) or the tokenizer's merged opening of a calculator call. One JSON line:

- `probes`, per model: teacher-forced on recovery probes (demonstrations with slips, never
  trained on; bench/recovery_token.py's), the median probability of each opening at every
  recovery turn that opens with `<tool_call>`;
- `after_first_refusal`, per model: its own sampled episodes (temperature 1, as an on-policy step
  samples them) on validation tasks, the turn right after its first refused call, classified:
  confirm, another call, malformed call, answer, other;
- `warm_refusals`: at the warm student's own first refusals, by kind (an environment refusal or
  a malformed call), the warm student's and the teacher's median probability of each opening:
  what on-policy distillation asks of the student in the states it reaches.

    python bench/recovery_fork.py [--world checked_prior] [--world-dir DIR] [--tasks 100]
                                  [--trained NAME=MODEL_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict

GENERIC_OPENING = 'Ċ{"name":Ġ"'
CALCULATOR_OPENING = 'Ċ{"name":Ġ"calculator",Ġ"arguments":Ġ{"expression":Ġ"'
SAMPLES_PER_TASK = 3


def turn_kind(text: str) -> str:
    if text.startswith('<tool_call>\n{"name": "confirm"'):
        return "confirm"
    if text.startswith('<tool_call>\n{"name": "'):
        return "another call"
    if text.startswith("<tool_call>"):
        return "malformed call"
    return "answer" if text.startswith("The answer is") else "other"


def median(values: list[float]) -> float:
    return float(f"{statistics.median(values):.3g}")


def main() -> None:
    import torch
    from recovery_token import add_world_arguments, world_and_models  # bench/ is on sys.path

    from opd.config import RolloutConfig
    from opd.data import completion_trajectory
    from opd.rollout import rollout
    from opd.tools import ToolExecutor
    from worlds.toolcalc.chain import ChainEnvironment, chain_record, generate_chain_tasks
    from worlds.toolcalc.prepare import assistant_turns, recovery_probes
    from worlds.toolcalc.tools import registry

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_world_arguments(parser, ("checked_prior", "checked"))
    parser.add_argument("--tasks", type=int, default=100, help="validation tasks sampled "
                                                               f"{SAMPLES_PER_TASK} times each")
    parser.add_argument("--probes", type=int, default=100)
    args = parser.parse_args()
    cfg, _, chat, models = world_and_models(args)
    tokenizer = chat.tokenizer
    tool_call = tokenizer.convert_tokens_to_ids("<tool_call>")
    openings = {"generic_opening": tokenizer.convert_tokens_to_ids(GENERIC_OPENING),
                "calculator_opening": tokenizer.convert_tokens_to_ids(CALCULATOR_OPENING)}

    def next_token_p(model, ids: list[int]):
        """Each position's next-token distribution, one forward pass."""
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    probes: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in recovery_probes(cfg, args.probes):
        trajectory = completion_trajectory(chat, record["messages"], record["tools"])
        ids = trajectory.input_ids
        forks = [start for start, _, after_rejection in assistant_turns(trajectory)
                 if after_rejection and ids[start] == tool_call]
        for role, model in models.items():
            p = next_token_p(model, ids) if forks else None
            for start in forks:
                for name, token in openings.items():
                    probes[role][name].append(p[start, token].item())

    held_out = frozenset(task.question for task in generate_chain_tasks(cfg.heldout_tasks,
                                                                        cfg.seed + 1))
    tasks = generate_chain_tasks(args.tasks, 3, exclude=held_out)  # bench/chain_takeover's split
    records = [chain_record(task, cfg.confirm, cfg.checked) for task in tasks] * SAMPLES_PER_TASK
    sampling = RolloutConfig(max_turns=cfg.max_turns, max_new_tokens=64,
                             max_total_len=cfg.max_total_len, batch_size=len(tasks),
                             temperature=1.0)
    after_first_refusal: dict[str, Counter] = {}
    warm_refusals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with ToolExecutor(registry(), environment=ChainEnvironment) as executor:
        for role, model in models.items():
            if role == "teacher":
                continue
            trajectories = rollout(model, chat, executor, records, sampling, seed=0)
            kinds = Counter(episodes=len(trajectories))
            for trajectory in trajectories:
                if not trajectory.refusal_ends:
                    continue
                end = trajectory.refusal_ends[0]  # after the next assistant turn's header
                kinds["with_a_refusal"] += 1
                kinds[turn_kind(tokenizer.decode(trajectory.input_ids[end:end + 24]))] += 1
                if role != "student":
                    continue
                observation = tokenizer.decode(trajectory.input_ids[max(0, end - 80):end])
                kind = "environment" if "did you mean" in observation else "malformed"
                context = trajectory.input_ids[:end] + [tool_call]
                for judge in ("student", "teacher"):
                    p = next_token_p(models[judge], context)[-1]
                    for name, token in openings.items():
                        warm_refusals[kind][f"{judge}_{name}"].append(p[token].item())
            after_first_refusal[role] = kinds
    print(json.dumps({
        "world": args.world,
        "probes": {role: {"turns": len(values["generic_opening"]),
                          **{f"median_p_{name}": median(v) for name, v in values.items()}}
                   for role, values in probes.items()},
        "after_first_refusal": after_first_refusal,
        "warm_refusals": {kind: {"refusals": len(values["student_generic_opening"]),
                                 **{f"median_p_{name}": median(v) for name, v in values.items()}}
                          for kind, values in warm_refusals.items()}}))


if __name__ == "__main__":
    main()
