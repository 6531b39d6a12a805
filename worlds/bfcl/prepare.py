"""Prepare the BFCL world: convert bfcl-eval's multi-turn data and split it, once per machine.

`prepare()` (recipe key `prepare: worlds.bfcl.prepare:prepare`, or `python -m worlds.bfcl.prepare`)
writes under `$OPD_CACHE_DIR` (default ~/.cache/opd-recipes)/bfcl/<key>/:

    data/train.jsonl     OPD prompts: the "train" scenarios of all four categories (676 records)
    data/heldout.jsonl   the held-out scenarios of all four categories (124 records), for eval
    data/<category>_{train,heldout}.jsonl   the same, per category
    prepare.json         counts, the bfcl-eval version, the split rule

`prepare_smoke()` (recipes/bfcl_smoke.yaml) writes a few short base tasks and two tiny random
Llama models of its own (head dim 32) on a copy of the toy tokenizer of worlds/toolcalc: a CPU
run of a few real BFCL episodes. `<key>` hashes the bfcl-eval version, this world's code and
the tokenizer files; `opd.cache.build_once` builds each once per machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
from importlib.metadata import version
from pathlib import Path

from opd import cache
from opd.data import write_jsonl
from worlds.bfcl.convert import CATEGORIES, HELDOUT_MODULUS, bfcl, convert

WORLD_DIR = Path(__file__).parent
SMOKE_TASKS = {"train": 4, "heldout": 2}


def _out(kind: str, root: str | Path | None, files: tuple[Path, ...] = ()) -> Path:
    """Where `kind` ("data" or "smoke") is cached: keyed by the bfcl-eval version and the code
    (and files) it is built from."""
    bfcl()
    key = cache.cache_key(f"{kind}\0{version('bfcl-eval')}",
                          (*sorted(WORLD_DIR.glob("*.py")), *files))
    return Path(root or cache.cache_root()) / "bfcl" / f"{kind}-{key}"


def _prepared(out: Path, build: bool, builder) -> Path | None:
    return cache.build_once(out, builder) if build else cache.cached(out)


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
    return _prepared(_out("data", root), build, _build_data)


# -- the CPU smoke world -----------------------------------------------------------------------

# The toy byte-level BPE tokenizer of the toolcalc world, with its Hermes chat template: data
# this world copies (not code it imports); its files are part of the smoke cache key.
SMOKE_TOKENIZER_DIR = WORLD_DIR.parent / "toolcalc" / "tokenizer"
SMOKE_TOKENIZER_FILES = tuple(sorted(SMOKE_TOKENIZER_DIR.glob("*")))
# Tiny random Llama decoders (head dim 32): the smoke world's own student and teacher.
SMOKE_STUDENT = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=128)
SMOKE_TEACHER = dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=256)
SMOKE_MAX_POSITIONS = 2048


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


def _smoke_model(shape: dict, tokenizer, seed: int, out: Path) -> None:
    """A freshly initialised Llama causal LM for `tokenizer`, saved with it to `out`."""
    import torch  # heavy: only the smoke models need torch and transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=SMOKE_MAX_POSITIONS,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True,
        temperature=1.0, top_p=1.0, top_k=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_smoke(out: Path) -> None:
    import torch  # heavy: as in _smoke_model
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    parts = smoke_records(convert(("base",)))
    (out / "data").mkdir(parents=True)
    for part, rows in parts.items():
        write_jsonl(out / "data" / f"{part}.jsonl", rows)
    shutil.copytree(SMOKE_TOKENIZER_DIR, out / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    for name, shape, seed in (("student", SMOKE_STUDENT, 0), ("teacher", SMOKE_TEACHER, 1)):
        _smoke_model(shape, tokenizer, seed, out / name)
    report = {"bfcl_eval": version("bfcl-eval"),
              "tasks": {part: [r["id"] for r in rows] for part, rows in parts.items()}}
    (out / "prepare.json").write_text(json.dumps(report, indent=2) + "\n")


def prepare_smoke(build: bool = True, root: str | Path | None = None) -> Path | None:
    return _prepared(_out("smoke", root, SMOKE_TOKENIZER_FILES), build, _build_smoke)


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
