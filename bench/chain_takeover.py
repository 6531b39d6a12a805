"""Who recovers from the student's own failures in the chain world? The student plays chains
until its first refused call; from exactly that state (the same tokens, the environment replayed
to the same state) the student, then the teacher, play on. One JSON line.

    python bench/chain_takeover.py [--tasks 200] [--student DIR] [--teacher DIR]

On-policy distillation can only teach recovery if (a) the teacher recovers from the states the
student reaches (not only from the slips it was trained on), and (b) the student can learn what
the teacher does there. This measures (a) directly: success of the teacher taking over at the
student's first refused call, greedy and sampled, against the student going on by itself.
(b) is bench/chain_design.py with `--init` the warm student and slipped demonstrations: the most
any recovery signal could teach it in that many steps.

The student's episodes are sampled (temperature 1, as an on-policy step samples them) and greedy
(as the eval plays). Tasks are validation tasks (generate_chain_tasks seed 3), never held-out.
Episodes run in the tool sandbox through opd.tools.ToolExecutor, as in rollout and eval, with the
recipe's turn and length limits; decoding is a plain token loop (one episode at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MAX_TURNS, MAX_NEW_TOKENS, MAX_TOTAL_LEN = 12, 64, 768  # recipes/toolcalc_chain.yaml's rollout


class Player:
    """Plays one model's turns of chain episodes from a token prefix (see the module docstring).
    Not opd.rollout: that starts every conversation from a dataset record's prompt, and a
    takeover starts from another model's tokens."""

    def __init__(self, chat, executor, generator):
        self.chat, self.executor, self.generator = chat, executor, generator

    def open(self, record: dict, replay: list[list]):
        """A fresh episode of `record`, with the calls of `replay` (per turn) run again in order:
        the chain environment's state is the values its calls returned, so it is the same."""
        episode, = self.executor.open_episodes([record["environment"]], [record["tools"]], [[]])
        for calls in replay:
            self.executor.run_episode_calls({episode: calls})
        return episode

    def turn(self, model, ids: list[int], sample: bool) -> list[int]:
        import torch

        from opd.rollout import cache_argument_name

        new: list[int] = []
        cache_name = cache_argument_name(model)
        with torch.no_grad():
            cache, inputs = None, torch.tensor([ids])
            while len(new) < MAX_NEW_TOKENS and len(ids) + len(new) < MAX_TOTAL_LEN:
                out = model(inputs, use_cache=True, **{cache_name: cache})
                cache = out[cache_name]
                logits = out["logits"][0, -1].float()
                token = int(torch.multinomial(torch.softmax(logits, -1), 1,
                                              generator=self.generator)) \
                    if sample else int(logits.argmax())
                new.append(token)
                if token in self.chat.stop_token_ids:
                    break
                inputs = torch.tensor([[token]])
        return new

    def play(self, model, record: dict, episode, ids: list[int], turns: list[list], sample: bool,
             stop_at_refusal: bool) -> dict:
        """Play on until the model answers (or a limit ends the episode); with
        `stop_at_refusal`, stop right after the first refused call's observation. `turns`: the
        calls of every turn so far (for a replay), extended in place."""
        from opd.chat import restrict_to_tools
        from opd.tool_calls import parse_hermes_tool_calls
        from worlds.toolcalc.chain import check_chain_answer

        tokenizer, refusals = self.chat.tokenizer, 0
        while True:
            new = self.turn(model, ids, sample)
            ids = ids + new
            if not new or new[-1] not in self.chat.stop_token_ids:
                return {"end": "length", "success": False, "ids": ids, "refusals": refusals}
            calls = restrict_to_tools(
                parse_hermes_tool_calls(tokenizer.decode(new, skip_special_tokens=False)),
                record["tools"])
            if not calls:
                answer = tokenizer.decode(new, skip_special_tokens=True)
                return {"end": "answer", "success": bool(check_chain_answer(answer, record)),
                        "ids": ids, "refusals": refusals}
            if len(turns) + 1 >= MAX_TURNS:
                return {"end": "max_turns", "success": False, "ids": ids, "refusals": refusals}
            results = self.executor.run_episode_calls({episode: calls})[episode]
            turns.append(calls)
            refused = [r for r in results if r.status != "ok"]
            refusals += len(refused)
            observation = self.chat.observation_ids([r.content for r in results],
                                                    record["tools"], ids[-1])
            if len(ids) + len(observation) >= MAX_TOTAL_LEN:
                return {"end": "max_total_len", "success": False, "ids": ids,
                        "refusals": refusals}
            ids = ids + observation
            if refused and stop_at_refusal:
                return {"end": "refused", "success": None, "ids": ids, "refusals": refusals,
                        "refusal": refused[0].content}


def refusal_kind(content: str) -> str:
    for kind in ("unknown number", "unknown place", "not valid JSON", "unknown attribute"):
        if kind in content:
            return kind
    return "other"


def takeover(player: Player, student, teacher, records: list[dict], sample: bool) -> dict:
    """The student plays each record (sampled or greedy) until its first refused call; from
    there the student goes on (decoding as before), and the teacher goes on, greedy and
    sampled. Success rates of each, over the episodes with a refused call, and the refused
    calls each makes after taking over, per episode."""
    ends, kinds = Counter(), Counter()
    wins: dict[str, list[bool]] = {"student": [], "teacher_greedy": [], "teacher_sampled": []}
    refusals: dict[str, list[int]] = {name: [] for name in wins}
    for record in records:
        prompt = player.chat.prompt_ids(record["messages"], record["tools"])
        turns: list[list] = []
        episode = player.open(record, [])
        first = player.play(student, record, episode, prompt, turns, sample, True)
        player.executor.close_episode(episode)
        ends[first["end"] + ("_ok" if first["success"] else "")] += 1
        if first["end"] != "refused":
            continue
        kinds[refusal_kind(first["refusal"])] += 1
        for name, model, sampled in (("student", student, sample),
                                     ("teacher_greedy", teacher, False),
                                     ("teacher_sampled", teacher, True)):
            episode = player.open(record, turns)
            rest = player.play(model, record, episode, first["ids"], list(turns), sampled, False)
            player.executor.close_episode(episode)
            wins[name].append(rest["success"])
            refusals[name].append(rest["refusals"])
    refused = ends["refused"]
    return {"success_without_refusal": ends["answer_ok"] / len(records),
            "refused_rate": refused / len(records),
            "first_refusal": dict(kinds.most_common()),
            "success_after_first_refusal": {
                name: round(sum(won) / refused, 3) if refused else None
                for name, won in wins.items()},
            "refused_calls_after_takeover": {
                name: round(sum(count) / refused, 2) if refused else None
                for name, count in refusals.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--student", help="default: the prepared chain world's warm student")
    parser.add_argument("--teacher", help="default: the prepared chain world's teacher")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from opd.chat import ChatFormat
    from opd.eval import load_model
    from opd.tools import ToolExecutor
    from worlds.toolcalc.chain import ChainEnvironment, chain_record, generate_chain_tasks
    from worlds.toolcalc.prepare import CHAIN_CONFIG, prepare
    from worlds.toolcalc.tokenizer import load_tokenizer
    from worlds.toolcalc.tools import registry

    torch.set_num_threads(1)
    world = prepare(CHAIN_CONFIG)
    chat = ChatFormat(load_tokenizer(world.tokenizer))
    student = load_model(args.student or world.student, "cpu", "--student")
    teacher = load_model(args.teacher or world.teacher, "cpu", "--teacher")
    heldout = frozenset(task.question for task in
                        generate_chain_tasks(CHAIN_CONFIG.heldout_tasks, CHAIN_CONFIG.seed + 1))
    records = [chain_record(task) for task in
               generate_chain_tasks(args.tasks, 3, exclude=heldout)]
    generator = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    result: dict = {"tasks": args.tasks, "student": str(args.student or world.student),
                    "teacher": str(args.teacher or world.teacher)}
    with ToolExecutor(registry(), environment=ChainEnvironment) as executor:
        player = Player(chat, executor, generator)
        for states in ("sampled", "greedy"):
            result[f"student_{states}"] = takeover(player, student, teacher, records,
                                                   states == "sampled")
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
