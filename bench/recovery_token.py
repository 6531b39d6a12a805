"""Why reverse KL cannot teach a recovery the student never makes: on a prepared chain world's
recovery probes (demonstrations with slips, never trained on), teacher-forced, the probability
the warm student and the teacher give the demonstration's token at the recovery's decision (the
first token of the recovery turn where the student's greedy choice differs; the last one if none
does). Full-vocabulary reverse KL moves a student logit in proportion to the student's own
probability of that token, forward KL in proportion to the teacher's.

    python bench/recovery_token.py [--world checked|checked_prior|confirm|chain] [--probes 100]
                                   [--trained NAME=MODEL_DIR ...] [--world-dir DIR]

`--trained` adds trained students (a bench/quality.py run's `final/`), read at the warm
student's decision tokens: did training raise the recovery's probability? Also printed: the most
common decisions, decoded (the demonstration's token and the warm student's greedy one), and the
first-order push each divergence gives the warm student's logit of the decision token, minus the
gradient of that token's loss, summed over the recovery turns: reverse KL(p || q) gives
p_k (log q_k - log p_k + KL), forward KL(q || p) gives q_k - p_k. One JSON line. Builds the world
if it is not cached (about 14 minutes); `--world-dir` reads one built before.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path


def add_world_arguments(parser: argparse.ArgumentParser, worlds: tuple[str, ...]) -> None:
    """--world, --world-dir and --trained: which prepared world, and the students to read."""
    parser.add_argument("--world", choices=worlds, default=worlds[0])
    parser.add_argument("--trained", nargs="*", default=[], metavar="NAME=MODEL_DIR",
                        help="trained students, read where the warm student is")
    parser.add_argument("--world-dir", help="a prepared world of --world's config, built before "
                                            "(default: its cache entry, built if missing)")


def world_and_models(args):
    """(config, world, chat, models): the named world (built if not cached), its chat format,
    and its warm student, teacher and `--trained` students in eval mode, one thread."""
    import torch
    from transformers import AutoModelForCausalLM

    from opd.chat import ChatFormat
    from worlds.toolcalc.prepare import NAMED_CONFIGS, Prepared, prepare
    from worlds.toolcalc.tokenizer import load_tokenizer

    cfg = NAMED_CONFIGS[args.world][0]
    torch.set_num_threads(1)
    world = Prepared(Path(args.world_dir)) if args.world_dir else prepare(cfg)
    chat = ChatFormat(load_tokenizer(world.tokenizer))
    paths = [("student", world.student), ("teacher", world.teacher),
             *(tuple(named.split("=", 1)) for named in args.trained)]
    models = {role: AutoModelForCausalLM.from_pretrained(path).eval() for role, path in paths}
    return cfg, world, chat, models


def main() -> None:
    import torch

    from opd.data import completion_trajectory
    from worlds.toolcalc.prepare import assistant_turns, recovery_probes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_world_arguments(parser, ("checked", "checked_prior", "confirm", "chain"))
    parser.add_argument("--probes", type=int, default=100)
    args = parser.parse_args()
    cfg, _, chat, models = world_and_models(args)
    probes = [completion_trajectory(chat, r["messages"], r["tools"])
              for r in recovery_probes(cfg, args.probes)]
    probabilities: dict[str, list[float]] = {role: [] for role in models}
    pushes = {"reverse_kl": 0.0, "forward_kl": 0.0}
    decisions: Counter = Counter()
    with torch.no_grad():
        for trajectory in probes:
            ids = trajectory.input_ids
            logprobs = {role: torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
                        for role, model in models.items()}
            for start, end, after_rejection in assistant_turns(trajectory):
                if not after_rejection:
                    continue
                decision = next((i for i in range(start, end)
                                 if logprobs["student"][i - 1].argmax().item() != ids[i]),
                                end - 1)
                for role in models:
                    probabilities[role].append(
                        logprobs[role][decision - 1, ids[decision]].exp().item())
                log_p, log_q = logprobs["student"][decision - 1], logprobs["teacher"][decision - 1]
                p_k, token = log_p[ids[decision]].exp(), ids[decision]
                kl = (log_p.exp() * (log_p - log_q)).sum()
                pushes["reverse_kl"] += (p_k * (log_q[token] - log_p[token] + kl)).item()
                pushes["forward_kl"] += (log_q[token].exp() - p_k).item()
                greedy = logprobs["student"][decision - 1].argmax().item()
                decisions[(chat.tokenizer.decode([token]), chat.tokenizer.decode([greedy]))] += 1
    print(json.dumps({"world": args.world, "recovery_turns": len(probabilities["student"]),
                      "decisions": [{"token": token, "student_greedy": greedy, "turns": count}
                                    for (token, greedy), count in decisions.most_common(5)],
                      **{f"push_{loss}_sum": round(total, 2) for loss, total in pushes.items()},
                      **{
        f"{role}_median_p": float(f"{statistics.median(values):.3g}")
        for role, values in probabilities.items()}, **{
        f"{role}_mean_p": round(statistics.mean(values), 4)
        for role, values in probabilities.items()}}))


if __name__ == "__main__":
    main()
