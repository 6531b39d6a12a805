"""Prepare the toolcalc world once per machine: data, tokenizer, a teacher that solves it, a
student that starts clearly worse.

`python -m worlds.toolcalc.prepare` (or `prepare()` from the trainer) writes, under
`$OPD_CACHE_DIR` (default ~/.cache/opd-recipes)/toolcalc/<key>/:

    tokenizer/  teacher/  student/      Hugging Face directories (from_pretrained)
    data/train.jsonl                    oracle conversations the teacher (and student) SFT on
    data/heldout.jsonl                  fixed held-out tasks for every eval
    data/prompts.jsonl                  OPD prompts, disjoint from held-out
    prepare.json                        parameters, timings, teacher/student held-out figures

`<key>` hashes the parameters and the code that shapes the artifacts, so an edit re-prepares and
an unchanged checkout reuses; built once per machine by `opd.cache.build_once`.

Shipped worlds: a build's teacher and student trained on CPU differ from machine to machine (float
differences of the kernels compound over thousands of SFT steps; the default world's teacher came
out 0.907 on one machine and 0.965 on another from the same code and seed). The worlds in
`SHIPPED_WORLDS` ship one build's teacher and warm student in worlds/toolcalc/shipped/<name>/
(`python -m worlds.toolcalc.prepare --<name> --ship` writes it), and their recipe steps
(`prepare_main`, `prepare_checked_prior`, `prepare_checked_prior_weak`) generate the data, which
is the same everywhere, and copy the shipped models: every machine starts from the same world in
seconds. `build_<name>` trains the world on this machine instead.

The teacher is judged by greedy held-out success (the eval default); its sampled (temperature 1)
success, which is what OPD's teacher scores alongside, is recorded too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from opd import cache
from opd.chat import ChatFormat
from opd.config import RolloutConfig
from opd.data import completion_trajectory, load_jsonl, write_jsonl
from opd.errors import MissingFileError, ModelFileError
from opd.eval import evaluate, greedy
from opd.tools import ToolExecutor
from worlds.toolcalc.chain import (
    ChainEnvironment,
    chain_oracle_record,
    chain_record,
    check_chain_answer,
    generate_chain_tasks,
)
from worlds.toolcalc.models import (
    CHAIN_STUDENT,
    STUDENT,
    TEACHER,
    TEST_SHAPE,
    ModelShape,
    build_model,
    count_parameters,
    save_model,
)
from worlds.toolcalc.sft import sft
from worlds.toolcalc.tasks import (
    FAMILIES,
    FAMILY_WEIGHTS,
    HARD_FAMILIES,
    HARD_FAMILY_WEIGHTS,
    check_answer,
    generate_tasks,
    oracle_record,
    task_record,
)
from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer
from worlds.toolcalc.tools import registry as toolcalc_registry

RECIPE_DIR = Path(__file__).parent
SHIPPED_DIR = RECIPE_DIR / "shipped"
REPO_DIR = RECIPE_DIR.parents[1]
# Code whose edits change what prepare builds; their text is part of the cache key.
KEYED_FILES = (*sorted(RECIPE_DIR.glob("*.py")), RECIPE_DIR / "chat_template.jinja",
               *sorted((RECIPE_DIR / "tokenizer").glob("*")),
               *(REPO_DIR / "opd" / name for name in ("data.py", "chat.py", "tool_worker.py")))


@dataclass(frozen=True)
class PrepareConfig:
    seed: int = 0
    train_tasks: int = 8000
    heldout_tasks: int = 200
    prompt_tasks: int = 2000
    teacher: ModelShape = TEACHER
    student: ModelShape = STUDENT
    batch_size: int = 16
    teacher_steps: int = 3000
    teacher_lr: float = 5e-3
    # If the schedule ends below target, more rounds at a low constant rate, up to this many.
    teacher_extra_rounds: int = 2
    teacher_extra_steps: int = 300
    # A warm start that is decent but clearly below the teacher (held-out 0.78 against 0.91 on
    # our machine). With 600 steps (0.27) the student's samples were too poor to learn from and
    # every method of the quality study ended below 0.7; 600, 1000 and 1500 were compared on its
    # validation split (BENCHMARKS.md). bench/capacity.py: 3000 steps reach the teacher.
    student_steps: int = 1500
    student_lr: float = 5e-3
    warmup_steps: int = 50
    target_success: float = 0.9
    # The task families and their weights (worlds.toolcalc.tasks), and the eval's turn limit.
    families: tuple[str, ...] = FAMILIES
    family_weights: tuple[float, ...] = FAMILY_WEIGHTS
    max_turns: int = 3
    eval_max_new_tokens: int = 64
    max_total_len: int = 512
    eval_batch_size: int = 100
    # One thread: on an idle 2-core machine two are ~1.4x faster, but on a shared one they
    # oversubscribe the cores and SFT steps slow down tenfold.
    threads: int = 1
    # "toolcalc" or "chain" (worlds.toolcalc.chain): in the chain world the teacher first learns
    # clean demonstrations of its own tasks (data/teacher_train.jsonl), then, for
    # `teacher_recovery_steps` at `teacher_recovery_lr`, those mixed with demonstrations of the
    # same tasks with slips at `slip_rate` per call and their corrections
    # (data/teacher_recovery.jsonl); neither file is given to the distiller. Trained on the mix
    # from scratch, the teacher learned neither (0.13 on validation after 3,000 steps, against
    # 0.99 for the clean one). The student's warm start and the oracle arm (data/train.jsonl)
    # are clean.
    world: str = "toolcalc"
    # The chain world's `confirm` tool (worlds.toolcalc.chain): a rejection's suggestion can be
    # run with one fixed call, and the teacher's recovery demonstrations use it.
    confirm: bool = False
    # And an environment that knows each task's calls (`checked`, with confirm): any call close
    # to the task's next one is rejected with that call as its suggestion.
    checked: bool = False
    slip_rate: float = 0.3
    teacher_recovery_steps: int = 0
    teacher_recovery_lr: float = 2e-3
    # A student that knows the recovery exists but rarely makes it, as a pretrained student knows
    # a tool's conventions: after its clean warm start, `student_recovery_steps` at
    # `student_recovery_lr` on its clean demonstrations plus `student_recovery_demos`
    # demonstrations with slips and corrections of other tasks (data/student_recovery.jsonl, never
    # given to the distiller). Without it the checked world's warm student gives the recovery's
    # decision token a median 1e-17, which no on-policy loss but forward KL can move.
    student_recovery_demos: int = 0
    student_recovery_steps: int = 0
    student_recovery_lr: float = 1e-3


# The worlds of the earlier studies (BENCHMARKS.md): the first, with a 600-step warm start; the
# same with 1,000; the harder world (three_hop tasks too, four assistant turns; run it with
# rollout.max_turns=4), with 600.
WEAK_START_CONFIG = PrepareConfig(student_steps=600)
START_1000_CONFIG = PrepareConfig(student_steps=1000)
# The default recipe's world (recipes/toolcalc_tiny.yaml): the 1,000-step warm start leaves the
# student far enough below the teacher for 250 steps to show a change, and 400 held-out tasks
# keep one eval's standard error near 0.023, so that change can be read (README). One thread:
# inside launch/train.py (OMP_WAIT_POLICY=PASSIVE) two made the teacher's SFT slower, not faster
# (8 steps/s against 13.5 on one, 2026-12-06).
MAIN_CONFIG = PrepareConfig(student_steps=1000, heldout_tasks=400)
HARD_CONFIG = PrepareConfig(families=HARD_FAMILIES, family_weights=HARD_FAMILY_WEIGHTS,
                            max_turns=4, student_steps=600)
# The chain world (worlds.toolcalc.chain): 400 held-out tasks (the study's standard errors), room
# for 7 calls plus recoveries; a 64-wide teacher (clean, then recoveries) and a 32-wide student
# whose clean warm start is long enough to reach its own plateau, so that what it still gets
# wrong is what it cannot copy, not what it has not yet seen.
CHAIN_CONFIG = PrepareConfig(world="chain", heldout_tasks=400, max_turns=12, max_total_len=768,
                             teacher=STUDENT, student=CHAIN_STUDENT, teacher_steps=2500,
                             teacher_extra_rounds=0, teacher_recovery_steps=1500,
                             teacher_recovery_lr=3e-3, target_success=0.85,
                             student_steps=5000)
# The chain world with `confirm` (the second chain world): the same tasks, models and steps.
CONFIRM_CONFIG = replace(CHAIN_CONFIG, confirm=True)
CHECKED_CONFIG = replace(CONFIRM_CONFIG, checked=True)
# The checked world with a student recovery prior: 400 recovery demonstrations among its 8,000
# clean ones for 200 steps put the recovery's decision token at a median 0.021 (0.011-0.028
# interquartile) on the recovery probes, greedy recovery still 0 (calibrated on the checked
# world's student: 100 among 2,000 gave 0.013, 300 among 2,000 0.24).
CHECKED_PRIOR_CONFIG = replace(CHECKED_CONFIG, student_recovery_demos=400,
                               student_recovery_steps=200)
# The same with a shorter clean warm start (2,000 steps instead of 5,000): a student that slips
# more often, the regime where the second build (warm student 0.302) had on-policy
# distillation level with KD.
CHECKED_PRIOR_WEAK_CONFIG = replace(CHECKED_PRIOR_CONFIG, student_steps=2000)
# The named worlds: `python -m worlds.toolcalc.prepare --<name>` and bench/recovery_token.py.
NAMED_CONFIGS = {"main": (MAIN_CONFIG, "the default recipe's world (1,000 warm steps, 400 "
                                        "held-out tasks)"),
                 "hard": (HARD_CONFIG, "the harder world (three_hop tasks too)"),
                 "chain": (CHAIN_CONFIG, "the chain world (worlds.toolcalc.chain)"),
                 "confirm": (CONFIRM_CONFIG, "the chain world with its confirm tool"),
                 "checked": (CHECKED_CONFIG, "the chain world with confirm and an environment "
                                             "that knows the calls"),
                 "checked_prior": (CHECKED_PRIOR_CONFIG, "the checked world whose student knows "
                                                         "the recovery exists"),
                 "checked_prior_weak": (CHECKED_PRIOR_WEAK_CONFIG, "the checked-prior world with "
                                                                   "a 2,000-step warm start")}
# The worlds that ship one build's models (the module docstring); the default recipe's and the
# checked-prior study worlds.
SHIPPED_WORLDS = ("main", "checked_prior", "checked_prior_weak")
SHIPPED_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")
TEST_CONFIG = PrepareConfig(
    train_tasks=64, heldout_tasks=8, prompt_tasks=8, teacher=TEST_SHAPE, student=TEST_SHAPE,
    batch_size=8, teacher_steps=3, teacher_extra_rounds=0, student_steps=2, warmup_steps=1,
    eval_max_new_tokens=8, eval_batch_size=8)


@dataclass
class Prepared:
    """Where a prepared world lives; `report` is prepare.json."""

    root: Path
    report: dict = field(default_factory=dict)

    def __fspath__(self) -> str:
        return str(self.root)

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def teacher(self) -> Path:
        return self.root / "teacher"

    @property
    def student(self) -> Path:
        return self.root / "student"

    @property
    def train_data(self) -> Path:
        return self.root / "data" / "train.jsonl"

    @property
    def teacher_train_data(self) -> Path:
        """The teacher's own clean demonstrations (the chain world's; other tasks than the
        distiller's)."""
        return self.root / "data" / "teacher_train.jsonl"

    @property
    def teacher_recovery_data(self) -> Path:
        """The chain teacher's demonstrations of recovery (slips, rejections, corrections)."""
        return self.root / "data" / "teacher_recovery.jsonl"

    @property
    def student_recovery_data(self) -> Path:
        """The student's own few recovery demonstrations (its prior; other tasks)."""
        return self.root / "data" / "student_recovery.jsonl"

    @property
    def heldout_data(self) -> Path:
        return self.root / "data" / "heldout.jsonl"

    @property
    def prompts_data(self) -> Path:
        return self.root / "data" / "prompts.jsonl"


def cache_key(cfg: PrepareConfig) -> str:
    return cache.cache_key(json.dumps(asdict(cfg), sort_keys=True), KEYED_FILES)


def prepare(cfg: PrepareConfig = PrepareConfig(), root: str | Path | None = None, *,
            force: bool = False, build: bool = True) -> Prepared | None:
    """The prepared world for `cfg`, built now unless already cached (`build=False`: the cached
    world or None, never building; `--dry-run` sizes the models with it)."""
    out = Path(root or cache.cache_root()) / "toolcalc" / cache_key(cfg)
    if build:
        cache.build_once(out, lambda staging: _build(cfg, Prepared(staging)), force=force)
    elif cache.cached(out) is None:
        return None
    return Prepared(out, json.loads((out / cache.MARKER).read_text()))


def prepare_shipped(name: str, root: str | Path | None = None, *, force: bool = False,
                    build: bool = True, shipped: Path | None = None) -> Prepared | None:
    """The shipped world `name` (SHIPPED_WORLDS) in the cache: this checkout's data and tokenizer
    with the models of worlds/toolcalc/shipped/<name>/ (or `shipped`); `build=False` as in
    `prepare`. Refuses, in one sentence, models shipped from other data than this checkout
    generates."""
    cfg, shipped = NAMED_CONFIGS[name][0], shipped or SHIPPED_DIR / name
    files = sorted(path for path in shipped.rglob("*") if path.is_file())
    if not files:
        raise MissingFileError(f"{shipped} holds no shipped world; write it with "
                                f"`python -m worlds.toolcalc.prepare --{name} --ship`.")
    key = cache.cache_key(json.dumps(asdict(cfg), sort_keys=True), [*KEYED_FILES, *files])
    out = Path(root or cache.cache_root()) / "toolcalc" / f"shipped-{name}-{key}"
    if build:
        cache.build_once(out, lambda staging: _unpack_shipped(cfg, name, shipped,
                                                              Prepared(staging)), force=force)
    elif cache.cached(out) is None:
        return None
    return Prepared(out, json.loads((out / cache.MARKER).read_text()))


def _unpack_shipped(cfg: PrepareConfig, name: str, shipped: Path, out: Prepared) -> None:
    report = json.loads((shipped / cache.MARKER).read_text())
    shutil.copytree(TOKENIZER_DIR, out.tokenizer)
    out.train_data.parent.mkdir(parents=True)
    _write_data(cfg, out)
    trained_on = data_digests(out)
    for path, digest in report["data"].items():
        if trained_on.get(path) != digest:
            raise ModelFileError(f"{shipped}'s models were trained on another {path} than "
                                 f"this checkout generates; ship a new build with `python "
                                 f"-m worlds.toolcalc.prepare --{name} --ship`.")
    tokenizer = load_tokenizer(out.tokenizer)
    _copy_models(shipped, out.root)
    for role in ("teacher", "student"):
        tokenizer.save_pretrained(out.root / role)
    report["shipped"] = str(shipped)
    (out.root / cache.MARKER).write_text(json.dumps(report, indent=2) + "\n")


def _copy_models(source: Path, to: Path) -> None:
    """The teacher's and student's weights and configs (not their tokenizer files)."""
    for role in ("teacher", "student"):
        (to / role).mkdir(parents=True)
        for file_name in SHIPPED_MODEL_FILES:
            shutil.copy(source / role / file_name, to / role / file_name)


def data_digests(world: Prepared) -> dict[str, str]:
    """sha256 of each data and tokenizer file of a prepared world, by path under its root: what
    its models were trained on."""
    files = sorted([*(world.root / "data").glob("*"), *world.tokenizer.glob("*")])
    return {str(path.relative_to(world.root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in files}


def ship(name: str, world: Prepared, to: Path | None = None) -> Path:
    """Copy a build of the world `name` (its teacher, warm student and report, with the digests
    of the data they were trained on) to worlds/toolcalc/shipped/<name>/ (or `to`)."""
    wanted = json.loads(json.dumps(asdict(NAMED_CONFIGS[name][0])))
    if {**world.report["config"], "threads": 1} != {**wanted, "threads": 1}:
        raise ValueError(f"{world.root} is not a build of the world {name!r} (its prepare.json "
                         f"config differs from {name}'s).")
    to = to or SHIPPED_DIR / name
    shutil.rmtree(to, ignore_errors=True)
    _copy_models(world.root, to)
    report = {**world.report, "data": data_digests(world)}
    (to / cache.MARKER).write_text(json.dumps(report, indent=2) + "\n")
    return to


def _step(world: PrepareConfig | str, doc: str) -> Callable[..., Prepared | None]:
    """A recipe's prepare step: the config's build, or the named world's shipped build."""
    def prepare_step(root: str | Path | None = None, *, force: bool = False,
                     build: bool = True) -> Prepared | None:
        if isinstance(world, str):
            return prepare_shipped(world, root, force=force, build=build)
        return prepare(world, root, force=force, build=build)

    prepare_step.__doc__ = doc
    return prepare_step


# Recipe prepare steps for the other worlds: the default recipe with
# `prepare=worlds.toolcalc.prepare:<name>`.
prepare_hard = _step(HARD_CONFIG, "The harder world (HARD_CONFIG); with "
                                          "rollout.max_turns=4.")
prepare_chain = _step(CHAIN_CONFIG, "The chain world (worlds.toolcalc.chain); with "
                                            "its recipe, recipes/toolcalc_chain.yaml.")
prepare_confirm = _step(CONFIRM_CONFIG, "The chain world with its confirm tool; with "
                                                "recipes/toolcalc_confirm.yaml.")
prepare_checked = _step(CHECKED_CONFIG, "The checked chain world; with "
                                                "recipes/toolcalc_confirm.yaml.")
prepare_checked_prior = _step("checked_prior", "The checked world whose student knows "
                                                      "the recovery exists, its shipped build; "
                                                      "with recipes/toolcalc_confirm.yaml.")
build_checked_prior = _step(CHECKED_PRIOR_CONFIG, "prepare_checked_prior, trained on "
                                                          "this machine instead of shipped.")
prepare_checked_prior_weak = _step("checked_prior_weak", "The checked-prior world with a "
                                                        "2,000-step warm start, its shipped "
                                                        "build.")
build_checked_prior_weak = _step(CHECKED_PRIOR_WEAK_CONFIG, "prepare_checked_prior_weak, "
                                                            "trained on this machine.")
prepare_weak_start = _step(WEAK_START_CONFIG, "The first study's world: 600 warm steps.")
prepare_start_1000 = _step(START_1000_CONFIG, "The world with 1,000 warm steps.")
prepare_main = _step("main", "The default recipe's world, its shipped build: 1,000 warm "
                                     "steps, 400 held-out tasks.")
build_main = _step(MAIN_CONFIG, "prepare_main, trained on this machine instead of "
                                        "shipped.")


def _build(cfg: PrepareConfig, out: Prepared) -> None:

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        _build_world(cfg, out)
    finally:
        torch.set_num_threads(threads)


def _build_world(cfg: PrepareConfig, out: Prepared) -> None:


    started = time.perf_counter()
    shutil.copytree(TOKENIZER_DIR, out.tokenizer)
    tokenizer = load_tokenizer(out.tokenizer)
    out.train_data.parent.mkdir(parents=True)
    _write_data(cfg, out)
    report = {"config": asdict(cfg), "key": out.root.name.split(".")[0]}

    chat = ChatFormat(tokenizer)

    def conversations(path: Path) -> list:
        return [completion_trajectory(chat, r["messages"], r["tools"])
                for r in tqdm(load_jsonl(path), desc="render SFT data", leave=False)]

    student_data = conversations(out.train_data)
    teacher_data = conversations(out.teacher_train_data) if out.teacher_train_data.exists() \
        else student_data
    recovery_data, probes = [], []
    if out.teacher_recovery_data.exists():
        recovery_data = conversations(out.teacher_recovery_data)
        probes = [completion_trajectory(chat, r["messages"], r["tools"])
                  for r in recovery_probes(cfg)]
    with Evaluator(tokenizer, load_jsonl(out.heldout_data), cfg) as evaluator:
        report["teacher"] = _prepare_teacher(cfg, tokenizer, teacher_data, recovery_data,
                                             evaluator, out, probes)
        student_recovery = conversations(out.student_recovery_data) \
            if out.student_recovery_data.exists() else []
        report["student"] = _prepare_student(cfg, tokenizer, student_data, student_recovery,
                                             evaluator, out, probes)
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out.root / "prepare.json").write_text(json.dumps(report, indent=2) + "\n")


def _write_data(cfg: PrepareConfig, out: Prepared) -> None:
    (_write_chain_data if cfg.world == "chain" else _write_toolcalc_data)(cfg, out)


def _write_toolcalc_data(cfg: PrepareConfig, out: Prepared) -> None:
    families = {"families": cfg.families, "weights": cfg.family_weights}
    heldout = generate_tasks(cfg.heldout_tasks, cfg.seed + 1, **families)
    held_questions = frozenset(task.question for task in heldout)
    train = generate_tasks(cfg.train_tasks, cfg.seed + 2, exclude=held_questions, **families)
    prompts = generate_tasks(cfg.prompt_tasks, cfg.seed + 3, exclude=held_questions, **families)
    write_jsonl(out.train_data, [oracle_record(task) for task in train])
    write_jsonl(out.heldout_data, [task_record(task) for task in heldout])
    write_jsonl(out.prompts_data, [task_record(task) for task in prompts])


def _write_chain_data(cfg: PrepareConfig, out: Prepared) -> None:
    """Held-out, prompt and clean demonstration tasks, and the teacher's own demonstrations of
    other tasks, with slips and corrections (seeds as in `_write_toolcalc_data`, the teacher's
    tasks seed + 4)."""
    heldout = generate_chain_tasks(cfg.heldout_tasks, cfg.seed + 1)
    held_questions = frozenset(task.question for task in heldout)
    train = generate_chain_tasks(cfg.train_tasks, cfg.seed + 2, exclude=held_questions)
    prompts = generate_chain_tasks(cfg.prompt_tasks, cfg.seed + 3, exclude=held_questions)
    teacher = generate_chain_tasks(cfg.train_tasks, cfg.seed + 4, exclude=held_questions)
    slips, world = random.Random(cfg.seed + 5), {"confirm": cfg.confirm, "checked": cfg.checked}
    write_jsonl(out.train_data, [chain_oracle_record(task, **world) for task in train])
    write_jsonl(out.teacher_train_data, [chain_oracle_record(task, **world) for task in teacher])
    write_jsonl(out.teacher_recovery_data,
                [chain_oracle_record(task, slips, cfg.slip_rate, **world) for task in teacher])
    write_jsonl(out.heldout_data, [chain_record(task, **world) for task in heldout])
    write_jsonl(out.prompts_data, [chain_record(task, **world) for task in prompts])
    if cfg.student_recovery_demos:
        slips = random.Random(cfg.seed + 8)
        write_jsonl(out.student_recovery_data,
                    [chain_oracle_record(task, slips, cfg.slip_rate, **world) for task in
                     generate_chain_tasks(cfg.student_recovery_demos, cfg.seed + 8,
                                          exclude=held_questions)])


def recovery_probes(cfg: PrepareConfig, count: int = 200) -> list[dict]:
    """Demonstrations with slips of tasks drawn with their own seed (seed + 6), never trained on:
    the probe of whether a model's next call after a rejection is the corrected one."""
    return [chain_oracle_record(task, random.Random(cfg.seed + 7 + i), cfg.slip_rate, cfg.confirm,
                                cfg.checked)
            for i, task in enumerate(generate_chain_tasks(count, cfg.seed + 6))]


def assistant_turns(trajectory):
    """(start, end, after_rejection) of each trained assistant turn of a demonstration, where
    after_rejection says it follows a weight-0 (slipped) turn."""
    after_rejection = False
    for start, end, kind in trajectory.spans:
        if kind == "assistant_context":
            after_rejection = True
        elif kind == "assistant":
            yield start, end, after_rejection
            after_rejection = False


def next_call_exactness(model, probes: list) -> dict:
    """Teacher-forced on demonstrations with slips: the share of assistant turns whose every
    token is the model's greedy choice, right after a rejected call (`after_rejection`: does it
    recover?) and elsewhere (`elsewhere`)."""
    exact = {"after_rejection": [], "elsewhere": []}
    model.eval()
    with torch.no_grad():
        for trajectory in probes:
            ids = trajectory.input_ids
            greedy_ids = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
            for start, end, after_rejection in assistant_turns(trajectory):
                exact["after_rejection" if after_rejection else "elsewhere"].append(
                    all(greedy_ids[i - 1] == ids[i] for i in range(start, end)))
    return {key: round(sum(values) / max(1, len(values)), 3) for key, values in exact.items()}


def _exactness(model, probes: list) -> dict:
    """The report's next-call exactness, where the world has recovery probes."""
    return {"next_call_exact": next_call_exactness(model, probes)} if probes else {}


def _prepare_teacher(cfg, tokenizer, conversations, recovery, evaluator, out: Prepared,
                     probes: list) -> dict:

    started = time.perf_counter()
    model = build_model(cfg.teacher, tokenizer, cfg.seed)
    losses = sft(model, conversations, steps=cfg.teacher_steps, batch_size=cfg.batch_size,
                 lr=cfg.teacher_lr, warmup_steps=cfg.warmup_steps, seed=cfg.seed,
                 desc="teacher SFT", pad_token_id=tokenizer.pad_token_id)
    success = evaluator(model, "eval teacher")
    rounds = 0
    while success["success_rate"] < cfg.target_success and rounds < cfg.teacher_extra_rounds:
        rounds += 1
        losses += sft(model, conversations, steps=cfg.teacher_extra_steps,
                      batch_size=cfg.batch_size, lr=cfg.teacher_lr / 10, warmup_steps=0,
                      seed=cfg.seed + rounds, desc=f"teacher SFT +{rounds}", schedule="constant",
                      pad_token_id=tokenizer.pad_token_id)
        success = evaluator(model, "eval teacher")
    if recovery and cfg.teacher_recovery_steps:
        # Clean and recovery demonstrations of the same tasks, shuffled together, so the teacher
        # keeps its clean calls while it learns to read a rejection.
        losses += sft(model, conversations + recovery, steps=cfg.teacher_recovery_steps,
                      batch_size=cfg.batch_size, lr=cfg.teacher_recovery_lr,
                      warmup_steps=cfg.warmup_steps, seed=cfg.seed + 50,
                      desc="teacher recovery SFT", pad_token_id=tokenizer.pad_token_id)
        success = evaluator(model, "eval teacher")
    sampled = evaluator(model, "eval teacher (sampled)", sampled=True)
    save_model(model, tokenizer, out.teacher)
    return {"parameters": count_parameters(model), "steps": len(losses), "extra_rounds": rounds,
            "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
            "heldout": success, "heldout_sampled": sampled, **_exactness(model, probes),
            "seconds": round(time.perf_counter() - started, 1)}


def _prepare_student(cfg, tokenizer, conversations, recovery, evaluator, out: Prepared,
                     probes: list) -> dict:

    started = time.perf_counter()
    model = build_model(cfg.student, tokenizer, cfg.seed + 100)
    losses = sft(model, conversations, steps=cfg.student_steps, batch_size=cfg.batch_size,
                 lr=cfg.student_lr, warmup_steps=cfg.warmup_steps, seed=cfg.seed + 100,
                 desc="student warm start", pad_token_id=tokenizer.pad_token_id)
    if recovery and cfg.student_recovery_steps:
        losses += sft(model, conversations + recovery, steps=cfg.student_recovery_steps,
                      batch_size=cfg.batch_size, lr=cfg.student_recovery_lr,
                      warmup_steps=cfg.warmup_steps // 5, seed=cfg.seed + 150,
                      desc="student recovery prior", pad_token_id=tokenizer.pad_token_id)
    heldout = evaluator(model, "eval student")
    sampled = evaluator(model, "eval student (sampled)", sampled=True)
    save_model(model, tokenizer, out.student)
    return {"parameters": count_parameters(model), "steps": len(losses),
            "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
            "heldout": heldout, "heldout_sampled": sampled, **_exactness(model, probes),
            "seconds": round(time.perf_counter() - started, 1)}


class Evaluator:
    """Held-out eval with one tool sandbox for the whole prepare (and bench/capacity.py);
    metrics without samples. `records` overrides the held-out tasks for one call."""

    def __init__(self, tokenizer, records: list[dict], cfg: PrepareConfig):

        self.tokenizer, self.records = tokenizer, records
        self.greedy = greedy(RolloutConfig(max_turns=cfg.max_turns,
                                           max_new_tokens=cfg.eval_max_new_tokens,
                                           max_total_len=cfg.max_total_len,
                                           batch_size=cfg.eval_batch_size))
        self.sampled = replace(self.greedy, top_k=0)
        chain = cfg.world == "chain"
        self.check = check_chain_answer if chain else check_answer
        self.executor = ToolExecutor(toolcalc_registry(),
                                     environment=ChainEnvironment if chain else None)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.executor.close()

    def __call__(self, model, desc: str, sampled: bool = False,
                 records: list[dict] | None = None) -> dict:

        chat = ChatFormat(self.tokenizer, generation_config=model.generation_config)
        metrics = evaluate(model, chat, self.executor, records or self.records, self.check,
                           self.sampled if sampled else self.greedy, progress=desc)
        metrics.pop("samples")
        return metrics


def main(argv: list[str] | None = None) -> Prepared:
    parser = argparse.ArgumentParser(description="Prepare the toolcalc world (cached).")
    parser.add_argument("--test", action="store_true", help="tiny models and steps (seconds)")
    for name, (_, help_text) in NAMED_CONFIGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=help_text)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--threads", type=int, help="torch threads (default 1; part of the key)")
    parser.add_argument("--ship", action="store_true",
                        help=f"copy the build's models to worlds/toolcalc/shipped/<name>/ (the "
                             f"worlds that ship: {', '.join(SHIPPED_WORLDS)})")
    parser.add_argument("--cache-dir", help="cache root (default $OPD_CACHE_DIR or "
                                            "~/.cache/opd-recipes)")
    args = parser.parse_args(argv)
    named = [name for name in NAMED_CONFIGS if getattr(args, name)]
    cfg = TEST_CONFIG if args.test else NAMED_CONFIGS[named[0]][0] if named else PrepareConfig()
    if args.ship and (args.test or not named or named[0] not in SHIPPED_WORLDS):
        parser.error(f"--ship needs one of --{' or --'.join(SHIPPED_WORLDS)}".replace("_", "-"))
    if args.threads:
        cfg = replace(cfg, threads=args.threads)
    prepared = prepare(cfg, args.cache_dir, force=args.force)
    report = prepared.report
    print(f"prepared {prepared.root} in {report['seconds']} s")
    if args.ship:
        print(f"shipped its models to {ship(named[0], prepared)}")
    for role in ("teacher", "student"):
        figures = report[role]
        print(f"{role}: {figures['parameters']:,} parameters, held-out success "
              f"{figures['heldout']['success_rate']:.3f} greedy, "
              f"{figures['heldout_sampled']['success_rate']:.3f} sampled")
    return prepared


if __name__ == "__main__":
    main()
