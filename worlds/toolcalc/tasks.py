"""The toolcalc world's tasks: seeded questions, their oracle conversations and gold answers.

Five families: `arithmetic` (calculator), `conversion` (convert_units), `lookup` (the fixed
table of invented places), `two_hop` (a lookup whose result feeds a calculator or a conversion)
and `direct` (echo a code back: answered without any tool). The harder world
(`worlds.toolcalc.prepare:prepare_hard`) adds `three_hop`: two lookups whose results feed a
calculator, four assistant turns, where a wrong first step compounds. Every task is written out
in the JSONL form users bring for real data (OpenAI-style `messages` + `tools`, the gold in
`answer`), so a user swaps in their own file unchanged.

The oracle calls the toy tools in-process, so its tool turns hold exactly the JSON the sandboxed
executor would return, and gold answers are those tools' (rounded) results.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass

from worlds.toolcalc.tools import (
    LOOKUP_TABLE,
    TEMPERATURE_UNITS,
    TOOL_FUNCTIONS,
    TOOL_SCHEMAS,
    UNIT_FACTORS,
)

FAMILIES = ("arithmetic", "conversion", "lookup", "two_hop", "direct")
FAMILY_WEIGHTS = (0.2, 0.2, 0.2, 0.25, 0.15)
HARD_FAMILIES = (*FAMILIES, "three_hop")
HARD_FAMILY_WEIGHTS = (0.15, 0.15, 0.15, 0.2, 0.1, 0.25)
ENTITIES = tuple(LOOKUP_TABLE)

# Unit pairs within a factor of 1000, so results stay short enough to copy.
_UNIT_PAIRS = tuple(
    [(a, b) for factors in UNIT_FACTORS.values() for a in factors for b in factors
     if a != b and 1e-3 <= factors[a] / factors[b] <= 1e3]
    + [(a, b) for a in TEMPERATURE_UNITS for b in TEMPERATURE_UNITS if a != b])
_ARITHMETIC_QUESTIONS = ("What is {}?", "Compute {}.", "Calculate {}.", "Evaluate {}.")
_CONVERSION_QUESTIONS = ("Convert {v} {a} to {b}.", "What is {v} {a} in {b}?",
                         "How many {b} is {v} {a}?")
_LOOKUP_QUESTIONS = {
    "population": ("What is the population of {}?", "How many people live in {}?"),
    # Not "How high is ... in <unit>?": that phrasing asks for a conversion (two_hop).
    "height_m": ("What is the height of {} in meters?", "How many meters tall is {}?"),
    "founded_year": ("When was {} founded?", "In what year was {} founded?"),
    "area_km2": ("What is the area of {} in km2?", "How large is {} in square km?"),
}
_ECHO_QUESTIONS = ("Repeat this code exactly: {}", "Say the code {} back to me.",
                   "Please echo the code {} without using any tool.")


@dataclass(frozen=True)
class ToolStep:
    """One oracle tool call and the JSON text the tool returns for it."""

    name: str
    arguments: dict
    content: str


@dataclass(frozen=True)
class Task:
    family: str
    question: str
    steps: tuple[ToolStep, ...]  # one tool call per assistant turn, in order
    answer: int | float | str


def _call(name: str, **arguments) -> tuple[ToolStep, int | float]:
    result = TOOL_FUNCTIONS[name](**arguments)
    return ToolStep(name, arguments, json.dumps(result, ensure_ascii=False)), result["result"]


def _arithmetic(rng: random.Random) -> Task:
    kind = rng.choice(("+", "-", "*", "/", "()"))
    if kind in "+-":
        expression = f"{rng.randint(10, 999)} {kind} {rng.randint(10, 999)}"
    elif kind == "*":
        expression = f"{rng.randint(2, 99)} * {rng.randint(2, 99)}"
    elif kind == "/":
        divisor = rng.randint(2, 12)
        dividend = divisor * rng.randint(2, 99) if rng.random() < 0.7 else rng.randint(10, 99)
        expression = f"{dividend} / {divisor}"
    else:
        expression = f"({rng.randint(1, 50)} + {rng.randint(1, 50)}) * {rng.randint(2, 9)}"
    step, result = _call("calculator", expression=expression)
    return Task("arithmetic", rng.choice(_ARITHMETIC_QUESTIONS).format(expression), (step,), result)


def _conversion(rng: random.Random) -> Task:
    source, target = rng.choice(_UNIT_PAIRS)
    if source in TEMPERATURE_UNITS:
        value = rng.randint(200, 400) if source == "K" else rng.randint(-40, 120)
    else:
        value = rng.randint(1, 99) if rng.random() < 0.8 else rng.randint(1, 99) / 10
    step, result = _call("convert_units", value=value, from_unit=source, to_unit=target)
    question = rng.choice(_CONVERSION_QUESTIONS).format(v=value, a=source, b=target)
    return Task("conversion", question, (step,), result)


def _lookup(rng: random.Random) -> Task:
    entity, attribute = rng.choice(ENTITIES), rng.choice(tuple(_LOOKUP_QUESTIONS))
    step, result = _call("lookup", entity=entity, attribute=attribute)
    return Task("lookup", rng.choice(_LOOKUP_QUESTIONS[attribute]).format(entity), (step,), result)


def _two_hop(rng: random.Random) -> Task:
    entity, kind = rng.choice(ENTITIES), rng.choice(("years", "height", "scale"))
    if kind == "years":
        year = rng.randint(2000, 2100)
        first, founded = _call("lookup", entity=entity, attribute="founded_year")
        second, result = _call("calculator", expression=f"{year} - {founded}")
        question = f"How many years before {year} was {entity} founded?"
    elif kind == "height":
        unit = rng.choice(("ft", "km", "mi", "cm"))
        first, height = _call("lookup", entity=entity, attribute="height_m")
        second, result = _call("convert_units", value=height, from_unit="m", to_unit=unit)
        question = f"How high is {entity} in {unit}?"
    else:
        factor = rng.randint(2, 9)
        first, population = _call("lookup", entity=entity, attribute="population")
        second, result = _call("calculator", expression=f"{population} * {factor}")
        question = f"What is {factor} times the population of {entity}?"
    return Task("two_hop", question, (first, second), result)


def _three_hop(rng: random.Random) -> Task:
    first, second = rng.sample(ENTITIES, 2)
    attribute, question = rng.choice((
        ("founded_year", f"How many years apart were {first} and {second} founded?"),
        ("population", f"What is the combined population of {first} and {second}?"),
        ("height_m", f"How many meters taller is the taller of {first} and {second}?")))
    first_step, a = _call("lookup", entity=first, attribute=attribute)
    second_step, b = _call("lookup", entity=second, attribute=attribute)
    expression = f"{a} + {b}" if attribute == "population" else f"{max(a, b)} - {min(a, b)}"
    third_step, result = _call("calculator", expression=expression)
    return Task("three_hop", question, (first_step, second_step, third_step), result)


def _direct(rng: random.Random) -> Task:
    code = f"{rng.randint(10, 99)}-{rng.randint(100, 999)}"
    return Task("direct", rng.choice(_ECHO_QUESTIONS).format(code), (), code)


_GENERATORS = {"arithmetic": _arithmetic, "conversion": _conversion, "lookup": _lookup,
               "two_hop": _two_hop, "direct": _direct, "three_hop": _three_hop}


def generate_tasks(count: int, seed: int, exclude: frozenset[str] = frozenset(),
                   families: tuple[str, ...] = FAMILIES,
                   weights: tuple[float, ...] = FAMILY_WEIGHTS) -> list[Task]:
    """`count` distinct tasks of `families` (drawn by `weights`), the same for the same
    arguments; questions in `exclude` are skipped (a held-out set is excluded from training this
    way)."""
    rng = random.Random(seed)
    tasks, seen = [], set(exclude)
    while len(tasks) < count:
        family = rng.choices(families, weights=weights)[0]
        task = _GENERATORS[family](rng)
        if task.question not in seen:
            seen.add(task.question)
            tasks.append(task)
    return tasks


def answer_text(answer: int | float | str) -> str:
    """The final assistant turn: the answer as the tool printed it (JSON number) or verbatim."""
    return f"The answer is {answer if isinstance(answer, str) else json.dumps(answer)}."


def task_record(task: Task) -> dict:
    """The task as a prompt-only dataset line (rollout, eval): question, tools, gold answer."""
    return {"messages": [{"role": "user", "content": task.question}], "tools": TOOL_SCHEMAS,
            "answer": task.answer, "family": task.family}


def oracle_record(task: Task) -> dict:
    """The task with the oracle's ideal turns: one tool call per turn, then the answer."""
    record = task_record(task)
    for step in task.steps:
        record["messages"] += [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": step.name, "arguments": step.arguments}}]},
            {"role": "tool", "content": step.content},
        ]
    record["messages"].append({"role": "assistant", "content": answer_text(task.answer)})
    return record


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def final_answer(text: str) -> str:
    """What follows the last "answer is" (or the whole text), without a closing period."""
    at = text.lower().rfind("answer is")
    answer = text[at + len("answer is"):] if at >= 0 else text
    answer = answer.strip().lstrip(":").strip()
    return answer[:-1].rstrip() if answer.endswith(".") else answer


def check_answer(final_text: str, record: dict) -> bool:
    """True when the final assistant text states the record's gold answer and nothing else:
    numbers compare to 1e-6 relative (commas allowed), strings exactly."""
    gold, answer = record["answer"], final_answer(final_text)
    if isinstance(gold, str):
        return answer == gold
    answer = answer.replace(",", "")
    if not _NUMBER.fullmatch(answer):
        return False
    return math.isclose(float(answer), gold, rel_tol=1e-6, abs_tol=1e-9)
