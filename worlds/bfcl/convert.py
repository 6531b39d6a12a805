"""BFCL multi-turn entries -> the project's JSONL records, and back to BFCL's call strings.

Reads bfcl-eval's own data files (`bfcl_eval/data/BFCL_v4_multi_turn_<category>.json`, their
`possible_answer/` twins and `multi_turn_func_doc/`), so the records are exactly the benchmark
the installed bfcl-eval scores. One record per BFCL entry:

    id              BFCL's id (multi_turn_base_17): its checker derives the category from it
    family          the category (base, miss_func, miss_param, long_context): opd.eval groups by it
    messages        one user message per BFCL turn; miss_func's empty "holdout" turn gets the
                    message bfcl-eval's prompting path for local models sends there
                    (base_handler.inference_multi_turn_prompting):
                    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING with the held-out
                    functions' BFCL docs (their Python repr, as its str.format writes the list),
                    then "I have updated some more functions you can choose from..."; a chat
                    template lists tools only in its opening system block, so this message is
                    the only place the model reads the new functions
    tools           OpenAI function schemas of the involved classes, in BFCL's order, without
                    miss_func's held-out functions
    tools_by_turn   miss_func only: per user turn, the schemas BFCL adds at that turn
    environment     {"involved_classes", "initial_config", "long_context"}: worlds.bfcl.
                    environment.BFCLEnvironment's config, as BFCL's executor loads it
    ground_truth    BFCL's ground-truth call strings per turn, verbatim (its checker's input)
    ground_truth_calls  the same calls as the student would emit them: per turn a list of
                    {"name", "arguments"} (positional arguments named), for replay
    split           "train" or "heldout" (below)

Schemas follow bfcl-eval's OpenAI function-calling conversion (model_handler.utils.
_cast_to_openai_type with GORILLA_TO_OPENAPI): dict -> object, float -> number (with BFCL's
" This is a float type value." note), tuple -> array, unknown or missing -> string; the
"response" part of BFCL's docs is not a parameter and is dropped.

Split (worlds/bfcl/README.md): a task is held out when sha256 of its number (the id's suffix,
shared by the four variants of one scenario) is 0 mod 5, so the split is the same for every
category and no held-out figure is on a scenario whose variant was trained on.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import inspect
import json
from functools import cache
from pathlib import Path
from typing import Any

from opd.errors import ConfigError

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
HELDOUT_MODULUS = 5  # one scenario in five is held out (~20%)
INSTALL_HINT = ("worlds.bfcl needs bfcl-eval: pip install --no-deps -r requirements-bfcl.txt "
                "(see worlds/bfcl/README.md)")


def bfcl():
    """bfcl_eval, or one sentence saying how to install it."""
    try:
        return importlib.import_module("bfcl_eval")
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] == "bfcl_eval":
            raise ConfigError(INSTALL_HINT + ".") from None
        raise


def data_dir() -> Path:
    return Path(bfcl().__file__).parent / "data"


@cache
def _backend_config():
    return importlib.import_module("bfcl_eval.constants.executable_backend_config")


@cache
def openai_types() -> dict[str, str]:
    bfcl()
    return importlib.import_module("bfcl_eval.constants.type_mappings").GORILLA_TO_OPENAPI


# The backends of the four multi-turn categories (web_search and memory, which need a network
# or embeddings and their packages, are out of scope).
MULTI_TURN_CLASSES = ("GorillaFileSystem", "MathAPI", "MessageAPI", "TicketAPI", "TradingBot",
                      "TravelAPI", "TwitterAPI", "VehicleControlAPI")


@cache
def backend_class(class_name: str) -> type:
    mapping = _backend_config().CLASS_FILE_PATH_MAPPING
    if class_name not in mapping:
        raise ValueError(f"unknown BFCL class {class_name!r}; known: {', '.join(mapping)}")
    return getattr(importlib.import_module(mapping[class_name]), class_name)


def stateless(class_name: str) -> bool:
    return class_name in _backend_config().STATELESS_CLASSES


@cache
def _function_docs(class_name: str) -> tuple[dict, ...]:
    name = _backend_config().MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
    path = data_dir() / "multi_turn_func_doc" / name
    return tuple(json.loads(line) for line in path.read_text().splitlines() if line.strip())


def function_docs(class_name: str) -> list[dict]:
    """BFCL's function docs of one backend class (deep copies)."""
    return copy.deepcopy(list(_function_docs(class_name)))


def _cast(properties: dict) -> dict:
    """BFCL's _cast_to_openai_type, on a copy, for the types its multi-turn docs use."""
    mapping = openai_types()
    out = {}
    for key, value in properties.items():
        value = dict(value)
        kind = value.get("type")
        if kind is None or kind not in mapping:
            value["type"] = "string"
        else:
            if kind == "float":
                value["format"] = "float"
                value["description"] = value.get("description", "") + \
                    " This is a float type value."
            value["type"] = mapping[kind]
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _cast(value["properties"])
            elif isinstance(value.get("items"), dict):
                value["items"] = _cast({"_": value["items"]})["_"]
        out[key] = value
    return out


def function_schema(doc: dict) -> dict:
    """An OpenAI tool schema from one BFCL function doc."""
    parameters = dict(doc.get("parameters") or {})
    parameters["type"] = "object"
    parameters["properties"] = _cast(parameters.get("properties", {}))
    return {"type": "function",
            "function": {"name": doc["name"], "description": doc.get("description", ""),
                         "parameters": parameters}}


def task_functions(involved_classes: list[str]) -> dict[str, str]:
    """Function name -> owning class, as BFCL's executor maps them (a later class wins)."""
    owners = {}
    for class_name in involved_classes:
        for doc in _function_docs(class_name):
            owners[doc["name"]] = class_name
    return owners


def task_schemas(involved_classes: list[str]) -> list[dict]:
    return [function_schema(doc) for class_name in involved_classes
            for doc in _function_docs(class_name)]


# -- call strings <-> JSON calls -------------------------------------------------------------

def parse_call(text: str, owners: dict[str, str]) -> dict:
    """BFCL's call string `name(a, b=1)` -> {"name", "arguments"} with positional arguments
    named from the backend method's signature. Literals only (ast.literal_eval), never eval."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    name = node.func.id
    if name not in owners:
        raise ValueError(f"{name!r} is not a function of this task: {text!r}")
    method = getattr(backend_class(owners[name]), name)
    parameters = [p for p in inspect.signature(method).parameters if p != "self"]
    arguments = {}
    for index, arg in enumerate(node.args):
        arguments[parameters[index]] = _json_value(ast.literal_eval(arg))
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError(f"**kwargs in a ground-truth call: {text!r}")
        arguments[keyword.arg] = _json_value(ast.literal_eval(keyword.value))
    return {"name": name, "arguments": arguments}


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return value


_LITERALS = (str, int, float, bool, type(None))


def _is_json(value: Any) -> bool:
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, _LITERALS):
        return True
    if isinstance(value, list):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


def call_string(name: str, arguments: dict) -> str:
    """The BFCL call string for a JSON call: `name(key=<Python literal>, ...)`.

    BFCL's checker `eval`s these strings; this is the one place they are made, and only from a
    name that is an identifier, identifier keys and JSON values (whose repr is a literal), so the
    string can only ever be that one method call. Anything else raises ValueError.
    """
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"not a function name: {name!r}")
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments of {name!r} are not an object")
    parts = []
    for key, value in arguments.items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ValueError(f"not an argument name: {key!r}")
        if not _is_json(value):
            raise ValueError(f"argument {key!r} of {name!r} is not a JSON value")
        parts.append(f"{key}={value!r}")
    return f"{name}({', '.join(parts)})"


# -- records ---------------------------------------------------------------------------------

def task_number(task_id: str) -> int:
    return int(task_id.rsplit("_", 1)[1])


def split_of(task_id: str) -> str:
    """"heldout" or "train": by the scenario number, the same for every category."""
    digest = hashlib.sha256(str(task_number(task_id)).encode()).hexdigest()
    return "heldout" if int(digest, 16) % HELDOUT_MODULUS == 0 else "train"


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_entries(category: str) -> list[tuple[dict, dict]]:
    """(entry, possible answer) pairs of one category, as bfcl-eval ships them."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; "
                         f"one of {', '.join(CATEGORIES)}")
    name = f"BFCL_v4_multi_turn_{category}.json"
    entries = _read_jsonl(data_dir() / name)
    answers = {a["id"]: a for a in _read_jsonl(data_dir() / "possible_answer" / name)}
    return [(entry, answers[entry["id"]]) for entry in entries]


def held_docs(involved_classes: list[str], names: list[str]) -> list[dict]:
    """The BFCL docs of miss_func's held-out `names`, as bfcl-eval's
    populate_test_cases_with_predefined_functions collects them: per name, the first doc of
    that name in the involved classes' docs, in the order of `names`."""
    docs = [doc for class_name in involved_classes for doc in function_docs(class_name)]
    return [next(doc for doc in docs if doc["name"] == name) for name in names]


def convert_entry(entry: dict, answer: dict, category: str) -> dict:
    """One BFCL entry (and its ground truth) as a project record."""
    from bfcl_eval.constants.default_prompts import (
        DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
    )

    classes = list(entry["involved_classes"])
    owners = task_functions(classes)
    held = {int(turn): list(names) for turn, names in entry.get("missed_function", {}).items()}
    held_names = {name for names in held.values() for name in names}
    schemas = task_schemas(classes)
    by_name = {s["function"]["name"]: s for s in schemas}
    messages, tools_by_turn = [], []
    for turn, turn_messages in enumerate(entry["question"]):
        if turn in held:
            if turn_messages:
                raise ValueError(f"{entry['id']}: holdout turn {turn} has user messages")
            turn_messages = [{"role": "user",
                              "content": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING
                              .format(functions=held_docs(classes, held[turn]))}]
        if [m["role"] for m in turn_messages] != ["user"]:
            raise ValueError(f"{entry['id']}: turn {turn} is not one user message")
        messages.extend({"role": m["role"], "content": m["content"]} for m in turn_messages)
        tools_by_turn.append([by_name[name] for name in held.get(turn, [])])
    ground_truth = answer["ground_truth"]
    if len(ground_truth) != len(entry["question"]):
        raise ValueError(f"{entry['id']}: {len(ground_truth)} ground-truth turns for "
                         f"{len(entry['question'])} question turns")
    record = {
        "id": entry["id"], "family": category, "split": split_of(entry["id"]),
        "messages": messages,
        "tools": [s for s in schemas if s["function"]["name"] not in held_names],
        "environment": {"involved_classes": classes, "initial_config": entry["initial_config"],
                        "long_context": "long_context" in category},
        "ground_truth": ground_truth,
        "ground_truth_calls": [[parse_call(call, owners) for call in turn]
                               for turn in ground_truth],
    }
    if held:
        record["tools_by_turn"] = tools_by_turn
    return record


def convert(categories: tuple[str, ...] = CATEGORIES) -> list[dict]:
    """Every entry of `categories`, converted, in BFCL's order."""
    return [convert_entry(entry, answer, category)
            for category in categories for entry, answer in load_entries(category)]
