"""Why reverse KL cannot teach a recovery the student never makes: on a prepared chain world's
recovery probes (demonstrations with slips, never trained on), teacher-forced, the probability
the warm student and the teacher give the demonstration's token at the recovery's decision (the
first token of the recovery turn where the student's greedy choice differs; the last one if none
does). Full-vocabulary reverse KL moves a student logit in proportion to the student's own
probability of that token, forward KL in proportion to the teacher's.

    python bench/recovery_token.py [--world checked|checked_prior|confirm|chain] [--probes 100]
                                   [--trained NAME=MODEL_DIR ...]

`--trained` adds trained students (a bench/quality.py run's `final/`), read at the warm
student's decision tokens: did training raise the recovery's probability? Prints one JSON line.
Builds the world if it is not cached (about 14 minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from opd.chat import ChatFormat
    from opd.data import completion_trajectory
    from worlds.toolcalc.prepare import (
        NAMED_CONFIGS,
        assistant_turns,
        prepare,
        recovery_probes,
    )
    from worlds.toolcalc.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", choices=("checked", "checked_prior", "confirm", "chain"),
                        default="checked")
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--trained", nargs="*", default=[], metavar="NAME=MODEL_DIR",
                        help="trained students, read at the warm student's decision tokens")
    args = parser.parse_args()
    cfg = NAMED_CONFIGS[args.world][0]
    torch.set_num_threads(1)
    world = prepare(cfg)
    chat = ChatFormat(load_tokenizer(world.tokenizer))
    paths = [("student", world.student), ("teacher", world.teacher),
             *(tuple(named.split("=", 1)) for named in args.trained)]
    models = {role: AutoModelForCausalLM.from_pretrained(path).eval() for role, path in paths}
    probes = [completion_trajectory(chat, r["messages"], r["tools"])
              for r in recovery_probes(cfg, args.probes)]
    probabilities: dict[str, list[float]] = {role: [] for role in models}
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
    print(json.dumps({"world": args.world, "recovery_turns": len(probabilities["student"]), **{
        f"{role}_median_p": float(f"{statistics.median(values):.3g}")
        for role, values in probabilities.items()}, **{
        f"{role}_mean_p": round(statistics.mean(values), 4)
        for role, values in probabilities.items()}}))


if __name__ == "__main__":
    main()
