"""python -m opd.teacher_data: the teacher's conversations on a recipe's prompts become a dataset
an off-policy run trains on, token for token as the teacher sampled them."""

import json

import pytest

from opd.chat import ChatFormat
from opd.data import load_jsonl
from opd.inputs import load_completions
from opd.teacher_data import main

RECIPE = "recipes/toolcalc_confirm.yaml"
WORLD = "prepare=worlds.toolcalc.prepare:prepare_checked_prior_weak"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The shipped weak world (its teacher solves 0.998 of held-out tasks), unpacked to a
    cache of this module's own (the recipe's prepare finds it there), and its first 12 prompts."""
    from worlds.toolcalc.prepare import prepare_shipped

    root = tmp_path_factory.mktemp("teacher_data")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPD_CACHE_DIR", str(root / "cache"))
        prepared = prepare_shipped("checked_prior_weak")
        assert prepared is not None
        records = load_jsonl(prepared.root / "data" / "prompts.jsonl")[:12]
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(record) + "\n" for record in records))
        yield prepared.root, prompts


def test_the_teachers_conversations_render_back_to_the_tokens_it_sampled(world, tmp_path):
    from transformers import AutoTokenizer

    root, prompts = world
    out = tmp_path / "teacher.jsonl"
    counts = main(["--recipe", RECIPE, "--out", str(out), "--seed", "3", "--device", "cpu",
                   WORLD, f"data.prompts={prompts}"])
    records = load_jsonl(out)
    assert counts["prompts"] == 12 and counts["kept"] == len(records) >= 10
    assert json.loads(out.with_suffix(".json").read_text())["kept"] == len(records)
    # Multi-call episodes with their tool results, loaded as a training run loads
    # data.completions: the assistant turns (and their stop tokens) are the only targets.
    chat = ChatFormat(AutoTokenizer.from_pretrained(root / "tokenizer"))
    completions = load_completions(str(out), chat, 1024)
    assert len(completions) == len(records)
    for record, trajectory in zip(records, completions):
        roles = [m["role"] for m in record["messages"]]
        assert roles.count("tool") >= 1 and roles[-1] == "assistant"
        assistant = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert sum(trajectory.assistant_mask) == sum(
            len(chat.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
            for text in assistant)
    # The same seed samples the same conversations.
    again = tmp_path / "again.jsonl"
    main(["--recipe", RECIPE, "--out", str(again), "--seed", "3", "--device", "cpu", WORLD,
          f"data.prompts={prompts}"])
    assert again.read_text() == out.read_text()


def test_an_output_that_would_overwrite_a_file_is_refused_before_anything_is_sampled(tmp_path):
    out = tmp_path / "teacher.jsonl"
    out.write_text("keep me\n")
    with pytest.raises(SystemExit, match=rf"^error: --out {out} exists; remove it or name "
                                         r"another file \(nothing was sampled\).$"):
        main(["--recipe", RECIPE, "--out", str(out), WORLD])
    assert out.read_text() == "keep me\n"
    # Its counts would overwrite the conversations.
    with pytest.raises(SystemExit, match=r"^error: --out .*/teacher.json: the conversations are "
                                         r"JSONL .*; name a .jsonl file.$"):
        main(["--recipe", RECIPE, "--out", str(tmp_path / "teacher.json"), WORLD])
    # No checker to tell a success: refused before the world is prepared.
    with pytest.raises(SystemExit, match=r"^error: --successful-only needs eval.checker "):
        main(["--recipe", RECIPE, "--out", str(tmp_path / "new.jsonl"), "--successful-only",
              WORLD, "eval.checker=", "data.eval="])


def test_a_word_the_teacher_sampled_in_pieces_is_kept_in_the_tokenizers_split(world):
    """A sampled split the tokenizer would not produce ("Thist" + "orra") cannot survive as
    text, so the line is kept with the tokenizer's split and counted; a conversation whose text
    does not come back is dropped."""
    from transformers import AutoTokenizer

    from opd.data import completion_trajectory
    from opd.teacher_data import rendered_back
    from opd.trajectory import AgentTrajectory

    root, prompts = world
    chat = ChatFormat(AutoTokenizer.from_pretrained(root / "tokenizer"))
    prompt = load_jsonl(prompts)[0]
    call = '<tool_call>\n{"name": "lookup", "arguments": {"entity": "Thistorra Flats", ' \
           '"attribute": "founded_year"}}\n</tool_call>'
    messages = [*prompt["messages"], {"role": "assistant", "content": call},
                {"role": "tool", "content": '{"result": 1551}'},
                {"role": "assistant", "content": "The answer is 1551."}]
    canonical = completion_trajectory(chat, messages, prompt.get("tools"))
    assert rendered_back(chat, prompt, canonical) == (messages, "exact")

    def rebuilt(replace):
        trajectory = AgentTrajectory.from_prompt(canonical.input_ids[:canonical.spans[0][1]])
        for start, end, kind in canonical.spans[1:]:
            trajectory.append(replace(canonical.input_ids[start:end], kind), kind)
        return trajectory

    def in_characters(ids, kind):  # the first call, one token per character, then its stop
        if kind != "assistant" or "lookup" not in chat.tokenizer.decode(ids):
            return ids
        text = chat.tokenizer.decode(ids[:-1])
        return [token for char in text
                for token in chat.tokenizer(char, add_special_tokens=False)["input_ids"]] + \
            ids[-1:]

    pieces = rebuilt(in_characters)
    assert pieces.input_ids != canonical.input_ids
    assert rendered_back(chat, prompt, pieces) == (messages, "retokenized")

    def observation_edited(old, new):
        def edit(ids, kind):
            if kind != "observation":
                return ids
            text = chat.tokenizer.decode(ids).replace(old, new)
            return chat.tokenizer(text, add_special_tokens=False)["input_ids"]
        return edit

    # Text outside the tags is lost on the way back; without tags no tool message is found.
    for old, new in [("<tool_response>", "note: <tool_response>"), ("<tool_response>\n", "")]:
        assert rendered_back(chat, prompt, rebuilt(observation_edited(old, new))) == \
            (None, "not_rendered_back")
