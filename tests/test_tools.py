"""Tool calls: parsing, schema validation, the sandboxed executor, and the toy-world tools."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tool_fixtures

from opd.tool_calls import ToolCall, get_parser, parse_hermes_tool_calls, register_parser
from opd.tool_schemas import Tool, ToolRegistry
from opd.tools import ToolExecutor, ToolResult
from opd.trajectory import ToolCallCounts
from worlds.toolcalc.tools import (
    LOOKUP_ATTRIBUTES,
    LOOKUP_TABLE,
    TEMPERATURE_UNITS,
    UNIT_DIMENSIONS,
    UNIT_FACTORS,
    calculator,
    convert,
    convert_units,
    lookup,
    round_result,
)
from worlds.toolcalc.tools import registry as toolcalc_registry

TIMEOUT_S = 1.5


def _registry() -> ToolRegistry:
    return ToolRegistry([Tool(schema, fn) for schema, fn in tool_fixtures.TEST_TOOLS]
                        + list(toolcalc_registry().tools))


@pytest.fixture(scope="module")
def executor():
    with ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=2) as pool:
        yield pool


def _call(name, **arguments) -> ToolCall:
    return ToolCall(name, arguments)


def _run_one(executor, call) -> ToolResult:
    return executor.run_batch([[call]])[0][0]


def _error(result: ToolResult) -> str:
    return json.loads(result.content)["error"]


# ---------------------------------------------------------------- parsing


def test_hermes_parses_several_calls_with_whitespace_and_string_arguments():
    text = ('Let me compute.\n<tool_call>\n  {"name": "calculator",\n "arguments": '
            '{"expression": "1 + 1"}}\n</tool_call>\nand <tool_call>{"name": "lookup", '
            '"arguments": "{\\"entity\\": \\"Veltrane\\", \\"attribute\\": \\"height_m\\"}"}'
            '</tool_call> done')
    calls = parse_hermes_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1 + 1"}, None),
        ("lookup", {"entity": "Veltrane", "attribute": "height_m"}, None)]
    assert calls[0].raw.startswith("<tool_call>\n  {") and calls[0].raw.endswith("</tool_call>")
    assert text.count(calls[1].raw) == 1


def test_hermes_accepts_unclosed_final_call_and_missing_arguments():
    calls = parse_hermes_tool_calls('<tool_call>{"name": "pid"}</tool_call>'
                                    '<tool_call>{"name": "echo", "arguments": {"text": "a"}}\n')
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("pid", {}, None), ("echo", {"text": "a"}, None)]
    cut = parse_hermes_tool_calls('<tool_call>{"name": "echo", "argu')
    assert cut[0].arguments is None and "not closed" in cut[0].error


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON"),
    ('["calculator"]', "must be a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": 7, "arguments": {}}', 'no "name"'),
    ('{"name": "echo", "arguments": "{not json"}', "string that is not valid JSON"),
    ('{"name": "echo", "arguments": [1, 2]}', "must be a JSON object, got an array"),
    ('{"name": "echo", "arguments": {"x": NaN}}', "NaN is not a JSON number"),
    ("[" * 100000, "not valid JSON"),
])
def test_hermes_reports_malformed_calls_without_raising(body, message):
    calls = parse_hermes_tool_calls(f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1
    assert calls[0].arguments is None and message in calls[0].error


def test_hermes_without_calls_and_parser_registry():
    assert parse_hermes_tool_calls("The answer is 42. <tool_response>x</tool_response>") == []
    assert get_parser("hermes") is parse_hermes_tool_calls

    def plain(text):
        return [ToolCall("echo", {"text": text})]

    register_parser("plain_for_test", plain)
    assert get_parser("plain_for_test")("hi")[0].arguments == {"text": "hi"}
    with pytest.raises(ValueError, match="already registered"):
        register_parser("plain_for_test", lambda text: [])
    with pytest.raises(ValueError, match="'mistral' is not a registered tool-call parser.*hermes"):
        get_parser("mistral")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("call, message", [
    (ToolCall("nope", {}), "unknown tool 'nope'; available tools: echo, typed"),
    (ToolCall(None, None, error="tool call is not valid JSON"), "tool call is not valid JSON"),
    (ToolCall("echo", ["a"]), "arguments of tool 'echo' must be a JSON object, got an array"),
    (_call("echo"), "tool 'echo' is missing required argument 'text'"),
    (_call("echo", text="a", extra=1),
     "tool 'echo' got unexpected argument 'extra'; it takes: text"),
    (_call("echo", text=3), "argument 'text' must be of type string, got a number (3)"),
    (_call("typed", text="a", count=1.5), "argument 'count' must be of type integer"),
    (_call("typed", text="a", count=True),
     "argument 'count' must be of type integer, got a boolean"),
    (_call("typed", text="a", ratio=False),
     "argument 'ratio' must be of type number, got a boolean"),
    (_call("typed", text="a", ratio="1"), "argument 'ratio' must be of type number, got a string"),
    (_call("typed", text="a", flag=1), "argument 'flag' must be of type boolean, got a number"),
    (_call("typed", text="a", items={}), "argument 'items' must be of type array, got an object"),
    (_call("typed", text="a", items=[1, "2"]), "argument 'items[1]' must be of type integer"),
    (_call("typed", text="a", options=[]), "argument 'options' must be of type object"),
    (_call("typed", text="a", options={}), "missing required argument 'options.depth'"),
    (_call("typed", text="a", options={"depth": "1"}), "argument 'options.depth' must be of type"),
    (_call("typed", text="a", color="blue"), 'argument \'color\' must be one of "red", "green", '
                                             'got "blue"'),
    (_call("convert_units", value=1, from_unit="parsec", to_unit="m"), "must be one of"),
])
def test_validate_names_the_problem(call, message):
    error = _registry().validate(call)
    assert error is not None and message in error


def test_validate_accepts_json_schema_values():
    registry = _registry()
    assert registry.validate(_call("typed", text="a", count=3, ratio=2, flag=False, items=[1, 2],
                                   options={"depth": 2.0}, color="red")) is None
    assert registry.validate(_call("typed", text="a", count=3.0, ratio=0.5)) is None
    assert registry.validate(_call("pid")) is None


def test_registry_rejects_bad_tools():
    schema, fn = tool_fixtures.TEST_TOOLS[0]
    with pytest.raises(ValueError, match="tool schema must look like"):
        ToolRegistry([Tool({"name": "echo"}, fn)])
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        ToolRegistry([Tool(schema, fn), Tool(schema, fn)])
    with pytest.raises(ValueError, match="cannot be sent to a worker process"):
        ToolRegistry([Tool(schema, lambda text: text)])
    bad_type = json.loads(json.dumps(schema))
    bad_type["function"]["parameters"]["properties"]["text"]["type"] = "float"
    with pytest.raises(ValueError, match="unsupported schema type 'float'"):
        ToolRegistry([Tool(bad_type, fn)])


def test_counts_each_call_once():
    counts = ToolCallCounts()
    counts.add([ToolResult("{}", "ok"), ToolResult("{}", "failed"), ToolResult("{}", "ok")])
    counts.add([ToolResult("{}", "invalid")])
    assert (counts.valid, counts.invalid, counts.failed) == (2, 1, 1)


# ---------------------------------------------------------------- executor


def test_executor_runs_rows_in_order(executor):
    rows = [[_call("calculator", expression=f"{i} * 3") for i in range(n)] for n in (3, 0, 5)]
    results = executor.run_batch(rows)
    assert [[r.content for r in row] for row in results] == [
        [json.dumps({"result": i * 3}) for i in range(n)] for n in (3, 0, 5)]
    assert all(r.status == "ok" for row in results for r in row)
    assert executor.run_batch([]) == []


FAILURES = [
    (_call("sleep", seconds=60), f"tool 'sleep' timed out after {TIMEOUT_S:g} s"),
    (_call("print_forever"), "tool 'print_forever' timed out"),
    (_call("fail", message="boom"), "tool 'fail' raised ValueError: boom"),
    (_call("exit_politely"), "tool 'exit_politely' raised SystemExit"),
    (_call("exit_hard"), "tool 'exit_hard' crashed its worker process (exit code 3)"),
    (_call("kill_self"),
     f"tool 'kill_self' crashed its worker process (exit code -{signal.SIGKILL.value})"),
    (_call("allocate_wildly"), "tool 'allocate_wildly' ran out of memory (limit 1024 MB)"),
    (_call("allocate_at_once"), "tool 'allocate_at_once' ran out of memory"),
    (_call("non_serialisable"),
     "returned a value that is not JSON-serialisable: Object of type set"),
    (_call("not_a_number"), "not JSON-serialisable: Out of range float values"),
    (_call("calculator", expression="__import__('os').getpid()"), "Call is not allowed"),
    (_call("convert_units", value=1, from_unit="km", to_unit="kg"), "cannot convert length"),
]


@pytest.mark.parametrize("bad, message", FAILURES, ids=[call.name for call, _ in FAILURES])
def test_failure_costs_one_error_and_executor_keeps_working(executor, bad, message):
    good = _call("calculator", expression="6 * 7")
    first, second = executor.run_batch([[good, bad], [good]])
    assert [r.status for r in first + second] == ["ok", "failed", "ok"]
    assert message in _error(first[1])
    after = executor.run_batch([[good] * 4])[0]
    assert [r.content for r in after] == ['{"result": 42}'] * 4


def test_invalid_calls_do_not_run(executor):
    results = executor.run_batch([[_call("exit_hard", now=True), ToolCall("kill", {})],
                                  parse_hermes_tool_calls("<tool_call>{oops</tool_call>")])
    assert [r.status for row in results for r in row] == ["invalid"] * 3
    counts = ToolCallCounts()
    for row in results:
        counts.add(row)
    assert (counts.valid, counts.invalid, counts.failed) == (0, 3, 0)


def test_huge_output_is_capped_to_valid_json(executor):
    result = _run_one(executor, _call("huge_result", size=10**6))
    assert result.status == "ok" and len(result.content) <= 2048
    prefix = json.loads(result.content)["truncated"]
    assert prefix == '"' + "x" * (len(prefix) - 1) and len(prefix) > 2000
    small = executor.run_batch([[_call("huge_result", size=10)]])[0][0]
    assert small.content == json.dumps("x" * 10)


@pytest.mark.parametrize("char", ['"', "\x00", "é"])
def test_cap_holds_for_escaped_characters_and_long_errors(char):
    registry = _registry()
    with ToolExecutor(registry, timeout_s=TIMEOUT_S, num_workers=1, max_result_chars=100) as pool:
        capped, error = pool.run_batch([[_call("huge_result", size=5000, char=char),
                                         _call("fail", message=char * 5000)]])[0]
    assert 100 - len(json.dumps(char)) < len(capped.content) <= 100  # cut as late as possible
    assert len(error.content) <= 100
    assert json.loads(capped.content)["truncated"].startswith(
        json.dumps(char * 5, ensure_ascii=False)[:-1])
    assert _error(error).startswith("tool 'fail' raised ValueError: " + char)


def test_memory_limit_leaves_room_for_normal_tools(executor):
    assert _run_one(executor, _call("allocate", mb=200)).content == str(200 * 2**20)


def test_worker_output_goes_nowhere(capfd):
    with ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=1) as pool:
        assert _run_one(pool, _call("noisy")).content == '"done"'
    captured = capfd.readouterr()
    assert "spam" not in captured.out and "spam" not in captured.err


def _wait_until_dead(pid: int) -> None:
    """Until every thread has exited, so the worker's socket is closed (a zombie leader is not
    enough: its other threads still hold the file table)."""
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X") and len(os.listdir(f"/proc/{pid}/task")) == 1:
                return
        except FileNotFoundError:
            return
        time.sleep(0.01)


def _worker_processes(executor) -> set[int]:
    """Every process of the idle workers: the launchers and the zygotes they forked."""
    pids, stack = set(), executor.pids()
    while stack:
        pid = stack.pop()
        pids.add(pid)
        with contextlib.suppress(FileNotFoundError):
            stack += map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    return pids


def test_idle_worker_killed_between_batches_is_replaced(executor):
    executor.run_batch([[_call("pid")] * 8])
    pids = _worker_processes(executor)
    assert len(pids) == 4  # a launcher and a zygote per worker
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        _wait_until_dead(pid)
    results = executor.run_batch([[_call("pid")] * 4])[0]
    assert [r.status for r in results] == ["ok"] * 4, results
    assert not pids & set(executor.pids())


def test_slurm_warning_signal_does_not_kill_workers(executor):
    """Slurm's USR1 reaches every process of the job step, tool workers included."""
    executor.run_batch([[_call("pid")] * 8])
    pids = _worker_processes(executor)
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    results = executor.run_batch([[_call("pid")] * 8])[0]
    assert [r.status for r in results] == ["ok"] * 8, results
    # The same workers, none replaced. A call's own process may still be exiting when the batch
    # returns (seen on a loaded machine, once for longer than 10 s under a load of 5 on 2 cores),
    # so wait for the tree to settle, and require only that every first worker still lives.
    deadline = time.monotonic() + 10
    while _worker_processes(executor) != pids and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids <= _worker_processes(executor)


def test_runs_from_threads(executor):
    outcome = {}

    def work(key, rows):
        outcome[key] = executor.run_batch(rows)

    threads = [threading.Thread(target=work, args=(i, [[_call("calculator", expression=f"{i} + 1")],
                                                       [_call("sleep", seconds=60)]]))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(2):
        (ok,), (slow,) = outcome[i]
        assert ok.content == json.dumps({"result": i + 1})
        assert slow.status == "failed" and "timed out" in _error(slow)


def test_a_slow_call_from_one_thread_does_not_hold_up_another(executor):
    """Threads' batches run at once, each on the pool workers it claims (completion order, not
    a duration, is what is checked)."""
    finished = []

    def run(name, call):
        (result,), = executor.run_batch([[call]])
        assert result.status == "ok", result
        finished.append(name)

    sleeping = threading.Thread(target=run, args=("slow", _call("sleep", seconds=1.0)))
    sleeping.start()
    time.sleep(0.3)  # the sleep is under way on one of the two workers
    run("quick", _call("calculator", expression="1 + 1"))
    sleeping.join()
    assert finished == ["quick", "slow"]


def test_close_stops_the_workers():
    pool = ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=2)
    pool.run_batch([[_call("pid")] * 6])
    pids = pool.pids()
    assert len(pids) == 2
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run_batch([[_call("pid")]])


def test_worker_that_cannot_import_its_tools_is_a_clear_error(tmp_path, monkeypatch):
    module = tmp_path / "vanishing_tools.py"
    module.write_text("def hello():\n    return 'hi'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vanishing_tools
    registry = ToolRegistry([Tool(tool_fixtures._schema("hello"), vanishing_tools.hello)])
    module.unlink()  # still imported here, no longer importable in a fresh worker
    with ToolExecutor(registry, num_workers=1) as pool:
        only_invalid = pool.run_batch([[ToolCall("hello", {"x": 1})]])  # starts no worker
        assert only_invalid[0][0].status == "invalid"
        with pytest.raises(RuntimeError, match="before it was ready: cannot load the tool "
                                               "functions: ModuleNotFoundError"):
            pool.run_batch([[ToolCall("hello", {})]])


def test_importing_tools_is_cheap():
    code = "import sys, opd.tools; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- toy-world tools


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-(4 - 10)", 6), ("+5", 5), ("7 // 2", 3),
    ("-7 // 2", -4), ("7 % 3", 1), ("2 ** 10", 1024), ("2 ** -2", 0.25), ("(3 + 4) * 2.5", 17.5),
    ("1 / 3", 0.333333), ("2 / 3", 0.666667), ("6 / 3", 2), ("1234567 / 1", 1234567),
    ("0.1 + 0.2", 0.3), (" 12 * 7 ", 84), ("1e3 / 8", 125), ("2 ** 0.5", 1.41421),
])
def test_calculator_matches_arithmetic(expression, expected):
    result = calculator(expression)["result"]
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "Name is not allowed"),
    ("__import__('os')", "Call is not allowed"),
    ("abs(-1)", "Call is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("().__class__", "Attribute is not allowed"),
    ("'a' * 3", "Constant is not allowed"),
    ("True + 1", "Constant is not allowed"),
    ("[1][0]", "is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("2 ** 65", "exponent 65 is outside [-64, 64]"),
    ("9 ** 9 ** 9", "exponent 387420489 is outside"),
    ("10 ** 15 * 10", "result magnitude exceeds 1e+15"),
    ("1e308 * 10", "result magnitude exceeds"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "complex"),
    ("1 +", "cannot parse"),
    ("import os", "cannot parse"),
    ("1" + " + 1" * 100, "longer than 256 characters"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("+", r"\+")):
        calculator(expression)


def test_round_result_keeps_integer_digits_and_six_significant():
    assert round_result(123456789.123) == 123456789
    assert round_result(0.000123456789) == 0.000123457
    assert round_result(-2.0) == -2 and type(round_result(-2.0)) is int
    assert round_result(0.0) == 0 and round_result(7) == 7


@pytest.mark.parametrize("value, from_unit, to_unit, expected", [
    (100, "C", "F", 212), (-40, "F", "C", -40), (0, "K", "C", -273.15), (300, "K", "F", 80.33),
    (1, "mi", "km", 1.60934), (3, "km", "m", 3000), (2, "lb", "kg", 0.907185),
    (90, "min", "h", 1.5), (1, "week", "h", 168), (5, "g", "mg", 5000), (12, "in", "ft", 1),
])
def test_convert_units(value, from_unit, to_unit, expected):
    assert convert_units(value, from_unit, to_unit) == {"result": expected}


def test_conversions_are_consistent():
    for dimension, factors in UNIT_FACTORS.items():
        for a in factors:
            for b in factors:
                assert convert(convert(7.5, a, b), b, a) == pytest.approx(7.5)
                assert convert(1, a, b) == pytest.approx(factors[a] / factors[b])
    for a in TEMPERATURE_UNITS:
        for b in TEMPERATURE_UNITS:
            assert convert(convert(310.0, a, b), b, a) == pytest.approx(310.0)
    with pytest.raises(ValueError, match="cannot convert time \\(s\\) to temperature \\(K\\)"):
        convert(1, "s", "K")
    with pytest.raises(ValueError, match="below absolute zero"):
        convert(-300, "C", "K")


def test_lookup_table_and_tool():
    assert len(LOOKUP_TABLE) == 40
    assert len({name.casefold() for name in LOOKUP_TABLE}) == 40
    for attributes in LOOKUP_TABLE.values():
        assert tuple(attributes) == LOOKUP_ATTRIBUTES
        assert all(type(value) in (int, float) for value in attributes.values())
    orsk = LOOKUP_TABLE["Orsk Station"]
    assert lookup("Orsk Station", "population") == {"result": orsk["population"]}
    assert lookup("  orsk   STATION ", "area_km2") == {"result": orsk["area_km2"]}
    with pytest.raises(ValueError, match="unknown entity 'Paris'"):
        lookup("Paris", "population")


def test_builtin_schemas_enumerate_the_world(executor):
    schemas = {s["function"]["name"]: s["function"] for s in toolcalc_registry().schemas}
    assert sorted(schemas) == ["calculator", "convert_units", "lookup"]
    units = schemas["convert_units"]["parameters"]["properties"]["from_unit"]["enum"]
    assert units == list(UNIT_DIMENSIONS) and set(UNIT_DIMENSIONS) >= set(TEMPERATURE_UNITS)
    text = ('<tool_call>{"name": "lookup", "arguments": {"entity": "Veltrane", "attribute": '
            '"founded_year"}}</tool_call><tool_call>{"name": "convert_units", "arguments": '
            '{"value": 2.5, "from_unit": "h", "to_unit": "min"}}</tool_call>')
    results = executor.run_batch([parse_hermes_tool_calls(text)])[0]
    assert [r.content for r in results] == [
        json.dumps({"result": LOOKUP_TABLE["Veltrane"]["founded_year"]}), '{"result": 150}']
