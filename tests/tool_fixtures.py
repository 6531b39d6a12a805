"""Misbehaving tools for tests/test_tools.py: module-level, so worker processes can import them."""

import os
import signal
import sys
import time


def echo(**arguments):
    return arguments


def pid():
    return os.getpid()


def sleep(seconds):
    time.sleep(seconds)
    return "woke up"


def fail(message):
    raise ValueError(message)


def exit_hard():
    os._exit(3)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def exit_politely():
    sys.exit(0)


def huge_result(size, char="x"):
    return char * size


def print_forever():
    while True:
        print("spam " * 100)
        os.write(2, b"spam on stderr\n")


def noisy():
    print("spam on stdout")
    os.write(2, b"spam on stderr\n")
    return "done"


def allocate_wildly():
    blocks = []
    while True:
        blocks.append(bytes(256 * 2**20))  # calloc: address space grows, pages stay untouched


def allocate_at_once():
    return len(bytearray(2**40))


def allocate(mb):
    return len(bytearray(mb * 2**20))


def non_serialisable():
    return {"numbers": {1, 2, 3}}


def not_a_number():
    return float("nan")


def _schema(name, properties=None, required=None):
    properties = properties or {}
    return {"type": "function", "function": {
        "name": name, "description": f"test tool {name}",
        "parameters": {"type": "object", "properties": properties,
                       "required": list(properties) if required is None else required}}}


TEST_TOOLS = [
    (_schema("echo", {"text": {"type": "string"}}), echo),
    (_schema("typed", {
        "text": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
        "flag": {"type": "boolean"}, "items": {"type": "array", "items": {"type": "integer"}},
        "options": {"type": "object", "properties": {"depth": {"type": "integer"}},
                    "required": ["depth"]},
        "color": {"type": "string", "enum": ["red", "green"]}},
        required=["text"]), echo),
    (_schema("pid"), pid),
    (_schema("sleep", {"seconds": {"type": "number"}}), sleep),
    (_schema("fail", {"message": {"type": "string"}}), fail),
    (_schema("exit_hard"), exit_hard),
    (_schema("kill_self"), kill_self),
    (_schema("exit_politely"), exit_politely),
    (_schema("huge_result", {"size": {"type": "integer"}, "char": {"type": "string"}},
             required=["size"]), huge_result),
    (_schema("print_forever"), print_forever),
    (_schema("noisy"), noisy),
    (_schema("allocate_wildly"), allocate_wildly),
    (_schema("allocate_at_once"), allocate_at_once),
    (_schema("allocate", {"mb": {"type": "integer"}}), allocate),
    (_schema("non_serialisable"), non_serialisable),
    (_schema("not_a_number"), not_a_number),
]
