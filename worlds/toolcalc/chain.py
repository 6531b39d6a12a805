"""The chain world: long tool-call chains where a student's own slips compound, and a teacher
that learned to recover from them on data the distiller never sees.

Why it exists: on the plain toolcalc world a student learns everything from demonstrations
alone, so on-policy data never beats off-policy data there (BENCHMARKS.md, quality study).
This world adds the three properties under which the literature expects on-policy distillation
to pay, each for a stated reason:

- **Compounding horizon.** A task is a chain of 3-7 dependent tool calls ("start from the height
  of Veltrane in meters, add 37, subtract the founding year of Ixmoor, multiply by 3"): every
  calculator call copies the previous result, so one slip early poisons every later step unless
  it is caught. Per-call slips of a small student multiply over the horizon.
- **Informative rejections.** The episode is stateful (`ChainEnvironment`): it knows every value
  the question states and every result returned so far, and rejects a calculator expression
  holding any other number, or a lookup of an unknown place, with an error naming the nearest
  known value ("unknown number 19355; did you mean 19335?"). A slip becomes a state the
  episode can recover from, but only a model that has learned to read that error and retry
  does.
- **Knowledge the distiller cannot read.** The teacher learns clean demonstrations of its own
  tasks, then those mixed with demonstrations of the same tasks with injected slips followed by
  their rejection and the corrected call (the slipped turn carries `"weight": 0`, so the teacher
  learns to recover, not to slip). The distiller never receives those demonstrations: it has
  prompts, the environment and the teacher. The teacher rarely slips when it writes
  conversations itself, so conversations it writes show few recoveries, while on-policy
  rollouts of the student reach its own slips, and the teacher scores the recovery there.
- **Capacity.** The student (`CHAIN_STUDENT`, 68k parameters, 32 wide) is ~3x smaller than the
  teacher (189k, 64 wide). The 64-wide shape learns the clean chains almost perfectly (0.99 on
  validation after 2,500 steps); the 32-wide one stays at about 0.8 after 5,000, and what it
  gets wrong is mostly a number copied wrong, which the environment rejects and it never
  recovers from (it was never shown a rejection).

The student's warm start stands for the small model's pretraining: clean demonstrations of the
chain tasks (never a failed call), long enough to reach its plateau, the same for every method.
`prepare.json` records, for teacher and student, how often their greedy next call is the
corrected one right after a rejected call (`next_call_exact.after_rejection`, teacher-forced on
demonstrations with slips of tasks drawn with their own seed). Success is the final answer
within the turn limit; a rejected call the episode recovered from does not fail it
(`check_chain_answer.forgives_failed_calls`).

**Confirm** (the second chain world, `PrepareConfig.confirm`): on the first chain world the
student could not learn the recovery (rewriting the call with the hinted number is the copying
it slipped at; BENCHMARKS.md), so on-policy distillation had nothing to teach it there. With
`"confirm": true` in a record's environment, a rejection that has a suggestion also says that a
`confirm` call runs the call again with it ("unknown number 19355; did you mean 19335? confirm
runs it"), as a shell's or a search box's "did you mean" does. Recovering then takes one fixed
call, a skill the small student can learn, while its slips stay (they come from its width).
The teacher's recovery demonstrations confirm when the suggestion is the intended value and
rewrite the call otherwise.

**Checked** (the third, `PrepareConfig.checked`, with confirm): the confirm world's student
failed mostly by a number the environment knew (the wrong operation on a stated number), which no
rejection catches. A checked episode's environment knows the task's calls (the record's
`"plan"`, never shown to the model) and accepts exactly the next one; a close miss (the same
tool, at most two numbers, operators or fields different) is rejected with the task's call as
the suggestion, any other call without one, so that a random call is never fixed. The teacher's
demonstrations add wrong operations to the slips. This is a validating API that knows the task,
added so that most of the student's mistakes become states a learnable recovery leaves.

Tasks are written in the same JSONL form as toolcalc's (`messages`, `tools`, `answer`), plus
`environment` (the values the question states) and `family` ("chain_<calls>", so evaluation
reports success by horizon).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import NoReturn

from opd.tool_worker import raised_content
from worlds.toolcalc.tasks import ENTITIES, ToolStep, answer_text, check_answer
from worlds.toolcalc.tools import LOOKUP_TABLE, TOOL_FUNCTIONS, TOOL_SCHEMAS, lookup

CALLS = (3, 4, 5, 6, 7)  # tool calls per chain: the horizons
# Integer attributes only, so every intermediate result is an integer the student copies.
_START = {"height_m": "Start from the height of {} in meters.",
          "founded_year": "Start from the founding year of {}.",
          "population": "Start from the population of {}."}
_OPERAND = {"height_m": "the height of {} in meters", "founded_year": "the founding year of {}"}
MAX_MAGNITUDE = 10**7  # results stay at most 4 two-digit chunks long
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
ERROR_LIMIT = 2048  # the observation cap; this world's errors are far shorter


@dataclass(frozen=True)
class ChainTask:
    calls: int
    question: str
    stated: tuple[int, ...]  # numbers the question states (the environment's first known values)
    steps: tuple[ToolStep, ...]
    answer: int

    @property
    def family(self) -> str:
        return f"chain_{self.calls}"


def _step(name: str, **arguments) -> tuple[ToolStep, int]:
    result = TOOL_FUNCTIONS[name](**arguments)
    return ToolStep(name, arguments, json.dumps(result)), result["result"]


def chain_task(rng: random.Random, calls: int) -> ChainTask:
    """A chain of exactly `calls` tool calls: a lookup, then calculator steps on the running
    result, some of which first look up another place's attribute to combine with."""
    entity, attribute = rng.choice(ENTITIES), rng.choice(tuple(_START))
    step, value = _step("lookup", entity=entity, attribute=attribute)
    sentences, steps, stated = [_START[attribute].format(entity)], [step], []
    while len(steps) < calls:
        if calls - len(steps) >= 2 and rng.random() < 0.4:
            other, other_attribute = rng.choice(ENTITIES), rng.choice(tuple(_OPERAND))
            step, operand = _step("lookup", entity=other, attribute=other_attribute)
            steps.append(step)
            sign = rng.choice("+-")
            sentences.append(("Add " if sign == "+" else "Subtract ")
                             + _OPERAND[other_attribute].format(other) + ".")
        else:
            sign = rng.choice("+-*" if abs(value) * 5 < MAX_MAGNITUDE else "+-")
            operand = rng.randint(2, 5) if sign == "*" else rng.randint(11, 99)
            stated.append(operand)
            sentences.append({"+": f"Add {operand}.", "-": f"Subtract {operand}.",
                              "*": f"Multiply by {operand}."}[sign])
        step, value = _step("calculator", expression=f"{value} {sign} {operand}")
        steps.append(step)
    question = " ".join(sentences) + " What is the result?"
    return ChainTask(calls, question, tuple(stated), tuple(steps), value)


def generate_chain_tasks(count: int, seed: int, exclude: frozenset[str] = frozenset(),
                         calls: tuple[int, ...] = CALLS) -> list[ChainTask]:
    """`count` distinct chain tasks, horizons drawn uniformly from `calls`; same arguments, same
    tasks; questions in `exclude` skipped."""
    rng = random.Random(seed)
    tasks, seen = [], set(exclude)
    while len(tasks) < count:
        task = chain_task(rng, rng.choice(calls))
        if task.question not in seen:
            seen.add(task.question)
            tasks.append(task)
    return tasks


CONFIRM_SCHEMA = {"type": "function", "function": {
    "name": "confirm",
    "description": "Run the last rejected call again with the value its error suggested.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}


def chain_record(task: ChainTask, confirm: bool = False, checked: bool = False) -> dict:
    """The task as a prompt-only dataset line (rollout, eval); `confirm`: the environment offers
    the `confirm` tool; `checked`: it also knows the task's calls (module docstring)."""
    environment: dict = {"stated": list(task.stated)}
    if confirm:
        environment["confirm"] = True
    if checked:
        environment["plan"] = [[step.name, step.arguments] for step in task.steps]
    return {"messages": [{"role": "user", "content": task.question}],
            "tools": [*TOOL_SCHEMAS, CONFIRM_SCHEMA] if confirm else TOOL_SCHEMAS,
            "answer": task.answer, "family": task.family, "environment": environment}


def _call_message(step: ToolStep, arguments: dict | None = None) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": step.name,
                                          "arguments": arguments or step.arguments}}]}


def chain_oracle_record(task: ChainTask, rng: random.Random | None = None,
                        slip_rate: float = 0.0, confirm: bool = False,
                        checked: bool = False) -> dict:
    """The task with the oracle's turns. With `slip_rate`, each call is first made with a slip
    (one digit pair or one letter changed) at that rate: the slipped turn has `"weight": 0` (a
    context turn, never a target), the environment's real rejection follows, then the correct
    call, or with `confirm` a `confirm` call where the rejection suggested the intended value:
    a demonstration of recovery. `checked`: a third of the calculator slips are a wrong
    operation instead, which only an environment that knows the task's calls rejects."""
    record = chain_record(task, confirm, checked)
    environment = ChainEnvironment(record["environment"])
    for step in task.steps:
        if rng is not None and rng.random() < slip_rate:
            slipped = _slip(step, rng, operations=checked)
            try:
                environment.call(step.name, slipped)
            except ValueError as error:
                record["messages"] += [dict(_call_message(step, slipped), weight=0),
                                       {"role": "tool", "content": raised_content(
                                           step.name, error, ERROR_LIMIT)}]
            if environment.suggested == (step.name, step.arguments):
                environment.call("confirm", {})
                record["messages"] += [_confirm_message(),
                                       {"role": "tool", "content": step.content}]
                continue
        environment.call(step.name, step.arguments)
        record["messages"] += [_call_message(step), {"role": "tool", "content": step.content}]
    record["messages"].append({"role": "assistant", "content": answer_text(task.answer)})
    return record


def _confirm_message() -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "confirm", "arguments": {}}}]}


def _slip(step: ToolStep, rng: random.Random, operations: bool = False) -> dict:
    """The step's arguments with one copying slip the environment rejects, or with
    `operations`, for a third of the calculator steps, the wrong operation."""
    if step.name == "lookup":
        entity = step.arguments["entity"]
        at = rng.randrange(1, len(entity))
        letter = rng.choice([c for c in "aeiounrst" if c != entity[at]])
        return dict(step.arguments, entity=entity[:at] + letter + entity[at + 1:])
    expression = step.arguments["expression"]
    if operations and rng.random() < 1 / 3:
        left, sign, right = expression.split(" ")
        return {"expression": f"{left} {rng.choice([o for o in '+-*' if o != sign])} {right}"}
    numbers = list(_NUMBER.finditer(expression))
    number = rng.choice(numbers)
    digits = number.group()
    at = rng.randrange(len(digits))
    digit = rng.choice([d for d in "0123456789" if d != digits[at]])
    wrong = digits[:at] + digit + digits[at + 1:]
    return {"expression": expression[:number.start()] + wrong + expression[number.end():]}


def _distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def _nearest(value: str, known: list[str]) -> str:
    """The known value closest to `value` by edit distance, then by length (a slip keeps the
    length), then the latest one."""
    return min(reversed(known), key=lambda candidate: (_distance(value, candidate),
                                                       abs(len(value) - len(candidate))))


class ChainEnvironment:
    """One chain episode: toolcalc's tools, strict about where numbers come from (see the
    module docstring). Config: the record's "environment", {"stated": [numbers]}, with
    "confirm": true for the `confirm` tool and "plan": [[name, arguments], ...] for a checked
    episode. `suggested`: the call a `confirm` would run now; `done`: calls accepted."""

    def __init__(self, config: dict):
        stated = config.get("stated") if isinstance(config, dict) else None
        if not isinstance(stated, list):
            raise ValueError('a chain environment needs {"stated": [numbers]}')
        self.known = [str(abs(number)) for number in stated]
        self.confirm = config.get("confirm") is True
        self.plan = config.get("plan")
        self.suggested: tuple[str, dict] | None = None
        self.calls = self.done = 0

    def call(self, name: str, arguments: dict):
        self.calls += 1
        if name == "confirm" and self.confirm:
            if self.suggested is None:
                raise ValueError("nothing to confirm: confirm runs the call the last error "
                                 "suggested")
            name, arguments = self.suggested
        self.suggested = None
        if self.plan is not None:
            self._check_plan(name, arguments)
        if name == "lookup":
            result = self._lookup(**arguments)
        elif name == "calculator":
            for number in _NUMBER.findall(arguments["expression"]):
                if number not in self.known:
                    if not self.known:
                        raise ValueError(f"unknown number {number}")
                    nearest = _nearest(number, self.known)
                    expression = re.sub(rf"(?<![\d.]){re.escape(number)}(?![\d.])", nearest,
                                        arguments["expression"], count=1)
                    self._reject(f"unknown number {number}; did you mean {nearest}?",
                                 ("calculator", {"expression": expression}))
            result = TOOL_FUNCTIONS["calculator"](**arguments)
        else:
            result = TOOL_FUNCTIONS[name](**arguments)
        self.known.append(str(abs(result["result"])))
        self.done += 1
        return result

    def _check_plan(self, name: str, arguments: dict) -> None:
        """A checked episode accepts exactly the task's next call; one close to it (the same
        tool, at most two numbers, operators or fields different) is rejected with it as the
        suggestion, any other without one, so that no call made at random is fixed."""
        if self.done >= len(self.plan):
            raise ValueError("the question has no more steps; give the answer")
        gold_name, gold_arguments = self.plan[self.done]
        parts, gold_parts = _parts(name, arguments), _parts(gold_name, gold_arguments)
        if name == gold_name and parts == gold_parts:
            return
        step = f"step {self.done + 1} of the question is not {_shown(name, arguments)}"
        if name == gold_name and len(parts) == len(gold_parts) \
                and sum(a != b for a, b in zip(parts, gold_parts)) <= 2:
            self._reject(f"{step}; did you mean {_shown(gold_name, gold_arguments)}?",
                         (gold_name, gold_arguments))
        raise ValueError(step)

    def _reject(self, message: str, suggested: tuple[str, dict]) -> NoReturn:
        if self.confirm:
            self.suggested = suggested
            message += " confirm runs it"
        raise ValueError(message) from None

    def _lookup(self, entity: str, attribute: str) -> dict:
        try:
            return lookup(entity, attribute)
        except ValueError as error:
            if not str(error).startswith("unknown entity"):
                raise
            nearest = _nearest(entity, list(LOOKUP_TABLE))
            self._reject(f"unknown place {entity}; did you mean {nearest}?",
                         ("lookup", {"entity": nearest, "attribute": attribute}))

    def state(self) -> dict:
        return {"calls": self.calls}


def _parts(name: str, arguments: dict) -> list[str]:
    if name == "calculator":
        return re.findall(r"\d+(?:\.\d+)?|[^\d\s]", str(arguments.get("expression", "")))
    return [str(arguments.get(key)) for key in sorted(arguments)]


def _shown(name: str, arguments: dict) -> str:
    if name == "calculator":
        return str(arguments.get("expression"))
    return f"{name}({', '.join(str(value) for value in arguments.values())})"


def check_chain_answer(final_text: str, record: dict) -> bool:
    """toolcalc's answer check; success forgives rejected calls the episode recovered from."""
    return check_answer(final_text, record)


check_chain_answer.forgives_failed_calls = True  # type: ignore[attr-defined]
