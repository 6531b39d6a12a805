"""opd.cache: the build-once cache every world's prepare step uses."""

from __future__ import annotations

import threading
import time

from opd.cache import MARKER, build_once, cache_key, cached


def _builder(calls: list):
    def build(staging):
        calls.append(staging)
        staging.mkdir()
        (staging / "payload").write_text(str(len(calls)))
        (staging / MARKER).write_text("{}")
    return build


def test_builds_once_and_reuses(tmp_path):
    calls: list = []
    out = tmp_path / "world" / "key"
    assert cached(out) is None
    assert build_once(out, _builder(calls)) == out
    assert build_once(out, _builder(calls)) == out
    assert len(calls) == 1 and cached(out) == out
    assert (out / "payload").read_text() == "1"
    assert not list(out.parent.glob("key.tmp-*"))


def test_force_rebuilds(tmp_path):
    calls: list = []
    out = tmp_path / "key"
    build_once(out, _builder(calls))
    build_once(out, _builder(calls), force=True)
    assert len(calls) == 2 and (out / "payload").read_text() == "2"


def test_what_a_crashed_builder_left_is_removed(tmp_path):
    out = tmp_path / "key"
    (tmp_path / "key.tmp-999999").mkdir(parents=True)  # a staging directory of a dead builder
    out.mkdir()  # a directory without its marker: no cache
    (out / "half").write_text("")
    calls: list = []
    build_once(out, _builder(calls))
    assert len(calls) == 1 and not (out / "half").exists()
    assert not (tmp_path / "key.tmp-999999").exists()


def test_concurrent_callers_wait_for_one_builder(tmp_path):
    calls: list = []
    build = _builder(calls)

    def slow(staging):
        time.sleep(0.2)  # widens the window two unlocked builders would race in
        build(staging)

    out = tmp_path / "key"
    threads = [threading.Thread(target=build_once, args=(out, slow)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and cached(out) == out


def test_key_follows_the_text_and_each_file(tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.json"
    first.write_text("x = 1")
    second.write_text("{}")
    key = cache_key("params", [first, second])
    assert key == cache_key("params", [first, second])
    assert key != cache_key("other", [first, second])
    second.write_text('{"changed": true}')
    assert key != cache_key("params", [first, second])
