"""The toolcalc world: task generator, gold answers, answer checker, tokenizer + chat template,
and the cached prepare step."""

from __future__ import annotations

import json
import operator
import re

import pytest

from opd.data import load_jsonl
from opd.tool_calls import ToolCall, parse_hermes_tool_calls
from opd.tools import ToolExecutor
from worlds.toolcalc.tasks import (
    FAMILIES,
    answer_text,
    check_answer,
    generate_tasks,
    oracle_record,
    task_record,
)
from worlds.toolcalc.tokenizer import TOKENIZER_DIR, build_tokenizer, load_tokenizer
from worlds.toolcalc.tools import LOOKUP_TABLE
from worlds.toolcalc.tools import registry as toolcalc_registry

# Naive references, written out independently of the tools' code.
METRES = {"m": 1, "km": 1000, "cm": 0.01, "mm": 0.001, "mi": 1609.344, "ft": 0.3048, "in": 0.0254}
KILOGRAMS = {"kg": 1, "g": 0.001, "mg": 1e-6, "t": 1000, "lb": 0.45359237,
             "oz": 0.028349523125}
SECONDS = {"s": 1, "min": 60, "h": 3600, "day": 86400, "week": 604800}
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def naive_convert(value, source, target):
    for table in (METRES, KILOGRAMS, SECONDS):
        if source in table:
            return value * table[source] / table[target]
    celsius = {"C": value, "F": (value - 32) * 5 / 9, "K": value - 273.15}[source]
    return {"C": celsius, "F": celsius * 9 / 5 + 32, "K": celsius + 273.15}[target]


def naive_arithmetic(expression):
    if match := re.fullmatch(r"\((\d+) \+ (\d+)\) \* (\d+)", expression):
        a, b, c = map(int, match.groups())
        return (a + b) * c
    a, op, b = expression.split()
    return OPS[op](int(a), int(b))


def naive_answer(task):
    """The gold answer recomputed from the question text alone."""
    q = task.question
    if task.family == "arithmetic":
        return naive_arithmetic(re.fullmatch(r"(?:What is|Compute|Calculate|Evaluate) (.+)[?.]",
                                             q).group(1))
    if task.family == "conversion":
        if match := re.fullmatch(r"(?:Convert|What is) (\S+) (\S+) (?:to|in) (\S+)[.?]", q):
            value, source, target = match.groups()
        else:
            target, value, source = re.fullmatch(r"How many (\S+) is (\S+) (\S+)\?", q).groups()
        return naive_convert(float(value), source, target)
    entity = next(name for name in LOOKUP_TABLE if name in q)
    facts = LOOKUP_TABLE[entity]
    if task.family == "lookup":
        for word, key in (("population", "population"), ("people", "population"),
                          ("tall", "height_m"), ("height", "height_m"),
                          ("founded", "founded_year"), ("area", "area_km2"), ("large", "area_km2")):
            if word in q:
                return facts[key]
    if "years before" in q:
        return int(re.search(r"before (\d+)", q).group(1)) - facts["founded_year"]
    if "times the population" in q:
        return int(re.search(r"What is (\d+) times", q).group(1)) * facts["population"]
    return naive_convert(facts["height_m"], "m", re.search(r" in (\w+)\?", q).group(1))


def test_generator_is_deterministic_distinct_and_covers_every_family():
    tasks = generate_tasks(300, seed=11)
    assert tasks == generate_tasks(300, seed=11)
    assert tasks != generate_tasks(300, seed=12)
    assert len({t.question for t in tasks}) == 300
    assert {t.family for t in tasks} == set(FAMILIES)
    held = frozenset(t.question for t in tasks[:50])
    assert not held & {t.question for t in generate_tasks(300, seed=11, exclude=held)}


def test_gold_answers_match_a_naive_recomputation_from_the_question():
    for task in generate_tasks(400, seed=21):
        if task.family == "direct":
            assert task.answer == re.search(r"\d\d-\d{3}", task.question).group(0)
            assert not task.steps
        else:
            assert task.answer == pytest.approx(naive_answer(task), rel=1e-5), task.question


def test_oracle_tool_turns_hold_what_the_sandboxed_tools_return():
    tasks = [t for t in generate_tasks(60, seed=31) if t.steps]
    steps = [step for task in tasks for step in task.steps]
    with ToolExecutor(toolcalc_registry(), timeout_s=5.0) as executor:
        results = executor.run_batch([[ToolCall(s.name, s.arguments)] for s in steps])
    assert [r[0].status for r in results] == ["ok"] * len(steps)
    assert [r[0].content for r in results] == [s.content for s in steps]


def test_records_are_openai_style_dataset_lines(tmp_path):
    task = next(t for t in generate_tasks(20, seed=41) if t.family == "two_hop")
    prompt, oracle = task_record(task), oracle_record(task)
    assert prompt["messages"] == [{"role": "user", "content": task.question}]
    assert prompt["tools"] == toolcalc_registry().schemas and prompt["answer"] == task.answer
    roles = [m["role"] for m in oracle["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert oracle["messages"][-1]["content"] == answer_text(task.answer)
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(prompt) + "\n" + json.dumps(oracle) + "\n")
    assert load_jsonl(path) == [prompt, oracle]


@pytest.mark.parametrize("text, gold, accepted", [
    ("The answer is 444.", 444, True),
    ("444", 444, True),
    ("The answer is: 1,446,600.", 1446600, True),
    ("the answer is 47.8333", 47.8333, True),
    ("The answer is 47.83330.", 47.8333, True),
    ("The answer is -12.", -12, True),
    ("The answer is 445.", 444, False),
    ("The answer is 4440.", 444, False),
    ("The answer is 47.83.", 47.8333, False),
    ("The answer is 444 or 445.", 444, False),
    ("I think 444, so the answer is 445.", 444, False),
    ("", 444, False),
    ("The answer is 27-606.", "27-606", True),
    ("The answer is 27-60.", "27-606", False),
    ("The answer is convert_units.", "convert_units", True),
    ("The answer is Convert_units.", "convert_units", False),
    ("The answer is convert_units, or lookup.", "convert_units", False),
    ('<tool_call>\n{"name": "lookup"}\n</tool_call>', 444, False),
])
def test_check_answer_accepts_the_gold_and_rejects_anything_else(text, gold, accepted):
    assert check_answer(text, {"answer": gold}) is accepted


def test_the_oracle_answer_passes_its_own_check():
    for task in generate_tasks(200, seed=51):
        assert check_answer(answer_text(task.answer), task_record(task))


def test_committed_tokenizer_is_what_the_builder_makes(tmp_path):
    build_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_text() == (TOKENIZER_DIR / name).read_text(), name
    assert sum(p.stat().st_size for p in TOKENIZER_DIR.iterdir()) < 1_000_000


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_tokenizer_round_trips_conversations_and_any_text(tokenizer):
    records = [oracle_record(task) for task in generate_tasks(30, seed=61)]
    texts = [tokenizer.apply_chat_template(r["messages"], tools=r["tools"], tokenize=False)
             for r in records]
    texts += ["héllo wörld ✓ 日本 \t\n  spaces", '{"expression": "(3 + 4) * 2.5"}', "Zürich 1e-6"]
    for text in texts:
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_numbers_are_two_digit_tokens_and_tool_tags_survive_skipping_specials(tokenizer):
    ids = tokenizer("Compute 40957 * 17 + 3.", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["40", "95", "7", "17", "3"]
    vocabulary = tokenizer.get_vocab()
    assert all(f"{n}" in vocabulary and f"{n:02d}" in vocabulary for n in range(100))
    call = '<tool_call>\n{"name": "lookup", "arguments": {"entity": "Ixmoor"}}\n</tool_call>'
    ids = tokenizer(call + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == call
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_template_renders_tools_calls_and_responses_hermes_style(tokenizer):
    tools = toolcalc_registry().schemas
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "When was Ixmoor founded?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "lookup", "arguments": {"entity": "Ixmoor", "attribute": "founded_year"}}}]},
        {"role": "tool", "content": '{"result": 1271}'},
        {"role": "assistant", "content": "The answer is 1271."},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>" in system
    assert rest == (
        "<|im_start|>user\nWhen was Ixmoor founded?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "lookup", "arguments": {"entity": "Ixmoor", "attribute": "founded_year"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"result": 1271}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nThe answer is 1271.<|im_end|>\n")
    call_turn = rest.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    [call] = parse_hermes_tool_calls(call_turn)
    assert (call.name, call.arguments, call.error) == (
        "lookup", {"entity": "Ixmoor", "attribute": "founded_year"}, None)
    prompt = tokenizer.apply_chat_template(messages[1:2], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhen was Ixmoor founded?<|im_end|>\n<|im_start|>assistant\n"


def test_test_mode_prepare_runs_end_to_end_and_is_cached(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worlds.toolcalc.prepare import TEST_CONFIG, cache_key, prepare

    prepared = prepare(TEST_CONFIG, tmp_path)
    assert prepared.root == tmp_path / "toolcalc" / cache_key(TEST_CONFIG)
    assert [p.name for p in (tmp_path / "toolcalc").iterdir() if p.is_dir()] == [prepared.root.name]
    committed = load_tokenizer()
    text = "<|im_start|>user\nWhat is 4095 * 17 in Veltrane?<|im_end|>\n"
    for role in ("teacher", "student"):
        path = getattr(prepared, role)
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        # The tokenizer a user loads from the model path is the one the model was trained with.
        assert tokenizer(text)["input_ids"] == committed(text)["input_ids"]
        assert model.generation_config.eos_token_id == tokenizer.eos_token_id
        figures = prepared.report[role]
        assert figures["heldout"]["num_tasks"] == TEST_CONFIG.heldout_tasks
        assert 0.0 <= figures["heldout"]["success_rate"] <= 1.0
        assert figures["steps"] == getattr(TEST_CONFIG, f"{role}_steps")
    assert len(load_jsonl(prepared.train_data)) == TEST_CONFIG.train_tasks
    held = {r["messages"][0]["content"] for r in load_jsonl(prepared.heldout_data)}
    assert len(held) == TEST_CONFIG.heldout_tasks
    assert not held & {r["messages"][0]["content"] for r in load_jsonl(prepared.prompts_data)}
    assert not held & {r["messages"][0]["content"] for r in load_jsonl(prepared.train_data)}

    marker = prepared.root / "kept"
    marker.write_text("")
    again = prepare(TEST_CONFIG, tmp_path)
    assert again.root == prepared.root and marker.exists() and again.report == prepared.report
    rebuilt = prepare(TEST_CONFIG, tmp_path, force=True)
    assert rebuilt.root == prepared.root and not marker.exists()


def test_cache_key_follows_the_parameters():
    from dataclasses import replace

    from worlds.toolcalc.prepare import TEST_CONFIG, cache_key

    assert cache_key(TEST_CONFIG) == cache_key(replace(TEST_CONFIG))
    assert cache_key(TEST_CONFIG) != cache_key(replace(TEST_CONFIG, teacher_steps=4))


@pytest.mark.parametrize("name", ["main", "checked_prior", "checked_prior_weak"])
def test_a_shipped_world_unpacks_the_models_it_was_trained_with_and_they_still_solve_it(
        tmp_path, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worlds.toolcalc.prepare import (
        NAMED_CONFIGS,
        SHIPPED_DIR,
        SHIPPED_WORLDS,
        Evaluator,
        prepare_shipped,
        ship,
    )

    assert name in SHIPPED_WORLDS
    # Unpacking regenerates the data and checks it against the digests the models were
    # trained on: a change to the task generators or the tokenizer fails here until the world
    # is shipped again.
    world = prepare_shipped(name, tmp_path)
    shipped = json.loads((SHIPPED_DIR / name / "prepare.json").read_text())
    assert world.report["teacher"] == shipped["teacher"] and world.report["shipped"]
    committed = load_tokenizer()
    text = "<|im_start|>user\nWhat is 4095 * 17 in Veltrane?<|im_end|>\n"
    for role in ("teacher", "student"):
        assert AutoTokenizer.from_pretrained(getattr(world, role))(text)["input_ids"] == \
            committed(text)["input_ids"]
    # The models still solve the world through this checkout's chat format, tools and eval.
    records = load_jsonl(world.heldout_data)[:40]
    teacher = AutoModelForCausalLM.from_pretrained(world.teacher).eval()
    with Evaluator(committed, records, NAMED_CONFIGS[name][0]) as evaluator:
        success = evaluator(teacher, "eval shipped teacher")["success_rate"]
    assert success >= 0.9, success

    marker = world.root / "kept"
    marker.write_text("")
    assert prepare_shipped(name, tmp_path).root == world.root and marker.exists()
    again = ship(name, world, to=tmp_path / "shipped")
    for path in (SHIPPED_DIR / name).rglob("*.safetensors"):
        assert (again / path.relative_to(SHIPPED_DIR / name)).read_bytes() == path.read_bytes()
    assert json.loads((again / "prepare.json").read_text())["data"] == shipped["data"]


def test_a_shipped_world_trained_on_other_data_is_refused_and_leaves_no_cache(tmp_path):
    import shutil

    from worlds.toolcalc.prepare import SHIPPED_DIR, prepare_shipped

    shipped = shutil.copytree(SHIPPED_DIR / "main", tmp_path / "shipped")
    report = json.loads((shipped / "prepare.json").read_text())
    report["data"]["data/heldout.jsonl"] = "0" * 64
    (shipped / "prepare.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match=r"shipped's models were trained on another "
                                         r"data/heldout.jsonl than this checkout generates; ship "
                                         r"a new build with `python -m worlds.toolcalc.prepare "
                                         r"--main --ship`"):
        prepare_shipped("main", tmp_path / "cache", shipped=shipped)
    assert not list((tmp_path / "cache" / "toolcalc").glob("*/prepare.json"))
    assert prepare_shipped("main", tmp_path / "cache", shipped=shipped, build=False) is None


def test_ship_refuses_a_build_of_another_world(tmp_path):
    from dataclasses import asdict

    from worlds.toolcalc.prepare import TEST_CONFIG, Prepared, ship

    build = Prepared(tmp_path / "build", {"config": asdict(TEST_CONFIG)})
    with pytest.raises(ValueError, match=r"build is not a build of the world 'main' \(its "
                                         r"prepare.json config differs from main's\)"):
        ship("main", build, to=tmp_path / "shipped")
    assert not (tmp_path / "shipped").exists()


@pytest.mark.slow
def test_full_prepare_gives_a_teacher_worth_distilling(tmp_path):
    from worlds.toolcalc.prepare import PrepareConfig, prepare

    report = prepare(PrepareConfig(), tmp_path).report
    teacher = report["teacher"]["heldout"]["success_rate"]
    student = report["student"]["heldout"]["success_rate"]
    print(json.dumps({"teacher": teacher, "student": student, "seconds": report["seconds"]}))
    assert teacher >= 0.9
    # A decent warm start with something left to distil (0.78 against 0.91 on our machine).
    assert 0.5 <= student <= teacher - 0.05


def test_sft_reports_along_one_schedule_in_eval_mode_and_keeps_training(tokenizer):
    import torch

    from opd.chat import ChatFormat
    from opd.data import completion_trajectory
    from worlds.toolcalc.models import TEST_SHAPE, build_model
    from worlds.toolcalc.sft import sft

    chat = ChatFormat(tokenizer)
    conversations = [completion_trajectory(chat, record["messages"], record["tools"])
                     for record in map(oracle_record, generate_tasks(8, seed=5))]
    model = build_model(TEST_SHAPE, tokenizer, seed=0)
    seen, weights = [], [model.lm_head.weight.detach().clone()]

    def report(step: int) -> None:
        seen.append((step, model.training))
        weights.append(model.lm_head.weight.detach().clone())

    losses = sft(model, conversations, steps=6, batch_size=4, lr=1e-2, warmup_steps=1, seed=0,
                 desc="test", pad_token_id=tokenizer.pad_token_id, every=2, on_every=report)
    assert seen == [(2, False), (4, False), (6, False)]
    assert len(losses) == 6 and not model.training
    # One run along one schedule: the weights moved between every two reports.
    assert all(not torch.equal(a, b) for a, b in zip(weights, weights[1:]))
