"""Prepare the BFCL world: convert bfcl-eval's multi-turn data and split it, once per machine.

`prepare()` (recipe key `prepare: worlds.bfcl.prepare:prepare`, or `python -m worlds.bfcl.prepare`)
writes under `$OPD_CACHE_DIR` (default ~/.cache/opd-recipes)/bfcl/<key>/:

    data/train.jsonl     OPD prompts: the "train" scenarios of all four categories (676 records)
    data/heldout.jsonl   the held-out scenarios of all four categories (124 records), for eval
    data/<category>_{train,heldout}.jsonl   the same, per category
    prepare.json         counts, the bfcl-eval version, the split rule

`prepare_smoke()` (recipes/bfcl_smoke.yaml) writes a few short base tasks and two tiny random
Llama models (head dim 32) on the toolcalc tokenizer: a CPU run of a few real BFCL episodes.
`<key>` hashes the bfcl-eval version and this world's code; building is atomic under a lock.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
from importlib.metadata import version
from pathlib import Path

from opd.data import write_jsonl
from worlds.bfcl.convert import CATEGORIES, HELDOUT_MODULUS, bfcl, convert

WORLD_DIR = Path(__file__).parent
SMOKE_TASKS = {"train": 4, "heldout": 2}


def cache_root() -> Path:
    return Path(os.environ.get("OPD_CACHE_DIR", Path.home() / ".cache" / "opd-recipes"))


def cache_key(kind: str) -> str:
    bfcl()
    digest = hashlib.sha256(f"{kind}\0{version('bfcl-eval')}".encode())
    for path in sorted(WORLD_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _cached(kind: str, build: bool, builder, root: str | Path | None) -> Path | None:
    parent = Path(root or cache_root()) / "bfcl"
    key = cache_key(kind)
    out = parent / f"{kind}-{key}"
    if (out / "prepare.json").exists() or not build:
        return out if (out / "prepare.json").exists() else None
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f"{kind}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "prepare.json").exists():
            staging = parent / f"{kind}-{key}.tmp-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            builder(staging)
            staging.rename(out)
    return out


def _split(records: list[dict]) -> dict[str, list[dict]]:
    return {part: [r for r in records if r["split"] == part] for part in ("train", "heldout")}


def _build_data(out: Path) -> None:
    records = convert()
    parts = _split(records)
    (out / "data").mkdir(parents=True)
    write_jsonl(out / "data" / "train.jsonl", parts["train"])
    write_jsonl(out / "data" / "heldout.jsonl", parts["heldout"])
    counts = {}
    for category in CATEGORIES:
        for part, rows in _split([r for r in records if r["family"] == category]).items():
            write_jsonl(out / "data" / f"{category}_{part}.jsonl", rows)
            counts[f"{category}_{part}"] = len(rows)
    report = {"bfcl_eval": version("bfcl-eval"), "counts": counts,
              "split": f"heldout when int(sha256(str(scenario number)), 16) % "
                       f"{HELDOUT_MODULUS} == 0"}
    (out / "prepare.json").write_text(json.dumps(report, indent=2) + "\n")


def prepare(build: bool = True, root: str | Path | None = None) -> Path | None:
    """The prepared BFCL data directory ("{prepared}"); None when not built and `build=False`."""
    return _cached("data", build, _build_data, root)


# -- the CPU smoke world -----------------------------------------------------------------------

SMOKE_STUDENT = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=128)
SMOKE_TEACHER = dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=256)


def smoke_records(records: list[dict]) -> dict[str, list[dict]]:
    """A few base tasks per split with the shortest prompts (tools included), descriptions
    shortened so that a byte-level toy tokenizer keeps them to a few thousand tokens."""
    chosen = {}
    for part, count in SMOKE_TASKS.items():
        pool = [r for r in records if r["family"] == "base" and r["split"] == part]
        pool.sort(key=lambda r: (len(json.dumps(r["tools"])), r["id"]))
        chosen[part] = [_shortened(r) for r in pool[:count]]
    return chosen


def _shortened(record: dict) -> dict:
    record = json.loads(json.dumps(record))
    for schema in record["tools"]:
        function = schema["function"]
        function["description"] = function["description"].rsplit("Tool description: ", 1)[-1]
        function["description"] = function["description"].split(".")[0][:80]
        for spec in function["parameters"]["properties"].values():
            spec.pop("description", None)
    return record


def _build_smoke(out: Path) -> None:
    import torch

    from worlds.toolcalc.models import ModelShape, build_model, save_model
    from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer

    torch.set_num_threads(1)
    parts = smoke_records(convert(("base",)))
    (out / "data").mkdir(parents=True)
    for part, rows in parts.items():
        write_jsonl(out / "data" / f"{part}.jsonl", rows)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    tokenizer.save_pretrained(out / "tokenizer")
    for name, shape, seed in (("student", SMOKE_STUDENT, 0), ("teacher", SMOKE_TEACHER, 1)):
        save_model(build_model(ModelShape(**shape), tokenizer, seed=seed), tokenizer, out / name)
    report = {"bfcl_eval": version("bfcl-eval"),
              "tasks": {part: [r["id"] for r in rows] for part, rows in parts.items()}}
    (out / "prepare.json").write_text(json.dumps(report, indent=2) + "\n")


def prepare_smoke(build: bool = True, root: str | Path | None = None) -> Path | None:
    return _cached("smoke", build, _build_smoke, root)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Convert and split BFCL multi-turn (cached).")
    parser.add_argument("--smoke", action="store_true", help="the CPU smoke world instead")
    parser.add_argument("--cache-dir", help="cache root (default $OPD_CACHE_DIR or "
                                            "~/.cache/opd-recipes)")
    args = parser.parse_args(argv)
    out = (prepare_smoke if args.smoke else prepare)(root=args.cache_dir)
    print(out)
    print((out / "prepare.json").read_text())
    return out


if __name__ == "__main__":
    main()
