"""bench/quality.py and quality_report.py: a study runs what it says, and the targets it prints
are read off its results honestly."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def quality_report():
    spec = importlib.util.spec_from_file_location("quality_report", BENCH / "quality_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality_report"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["quality_report"]


def result(method: str, seed: int, heldout: float, curve: list[tuple[int, float]],
           episodes_per_step: int) -> dict:
    return {
        "method": method, "seed": seed, "steps": 200, "heldout_success": heldout,
        "heldout": {"num_tasks": 400}, "heldout_truncation_rate": 0.0,
        "heldout_per_group": {}, "student_tokens_trained": 1, "teacher_tokens_scored": 1,
        "wall_s": 1.0, "student_episodes": 200 * episodes_per_step,
        "validation_curve": curve,
        "samples_curve": [(step * episodes_per_step, rate) for step, rate in curve],
        "references": {name: {"heldout": {"num_tasks": 400, "success_rate": rate,
                                          "truncation_rate": 0.0, "per_group": {}},
                              "validation": {"success_rate": rate, "num_tasks": 100}}
                       for name, rate in (("teacher", 0.99), ("student", 0.05))}}


def write_study(out: Path, rl_curve: list[tuple[int, float]], rl_advantage_std: float) -> None:
    results = []
    for seed in range(3):
        results += [
            result("kd_teacher", seed, 0.10 + 0.005 * seed, [(50, 0.08), (200, 0.1)], 0),
            result("opd_hybrid_kl", seed, 0.15 + 0.005 * seed,
                   [(10, 0.04), (20, 0.09), (50, 0.12), (200, 0.15)], 32),
            result("rl", seed, 0.05, rl_curve, 32)]
        run = out / "runs" / f"rl-seed{seed}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": step, "advantage_std": rl_advantage_std if step % 4 else 0.0,
                        "off_policy": False, "invalid_tool_calls": 0, "failed_tool_calls": 0,
                        "conversations": 32, "truncation_rate": 0.0}) + "\n"
            for step in range(1, 201)))
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))


def targets(out: Path) -> list[str]:
    text = (out / "quality.md").read_text()
    return text.split("Targets:\n\n")[1].split("\n\n")[0].splitlines()


def test_the_report_reads_the_margin_and_the_episodes_opd_needs_to_reach_rl(
        tmp_path, quality_report):
    write_study(tmp_path, [(50, 0.06), (200, 0.12)], rl_advantage_std=0.5)
    quality_report.report(tmp_path)
    margin, samples = targets(tmp_path)
    assert margin.startswith("- best OPD (opd_hybrid_kl) 0.155 against the best teacher-data "
                             "off-policy method (kd_teacher) 0.105: difference +0.050")
    # RL ends at 0.12 after 6,400 episodes; hybrid_kl's curve first reaches it at step 50.
    assert samples == ("- RL's final validation success 0.120 after 6,400 student episodes; "
                       "opd_hybrid_kl reaches it after 1,600 (4.0x fewer; target: at least 5x). "
                       "Steps with any reward signal (advantage std > 0): 75%.")


@pytest.mark.parametrize("rl_final", [0.04, 0.09])
def test_an_rl_arm_that_never_leaves_the_start_is_reported_as_not_learning(
        tmp_path, quality_report, rl_final):
    # 0.09 against the start's 0.05 on 100 tasks is inside two standard errors: noise.
    write_study(tmp_path, [(50, 0.05), (200, rl_final)], rl_advantage_std=0.0)
    quality_report.report(tmp_path)
    samples = targets(tmp_path)[1]
    assert "is within two standard errors of the warm student's 0.050: RL did not learn" \
        in samples
    assert "fewer" not in samples and "(advantage std > 0): 0%." in samples


def test_a_study_from_an_earlier_runs_student_names_it_as_the_start(tmp_path, quality_report):
    write_study(tmp_path, [(50, 0.05), (200, 0.06)], rl_advantage_std=0.5)
    results = [{**json.loads(line), "start": "runs/kd/final"}
               for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    quality_report.report(tmp_path)
    text = (tmp_path / "quality.md").read_text()
    assert "| student of runs/kd/final (start) | | 0.050 |" in text
    assert "warm student" not in text
    assert "within two standard errors of the student of runs/kd/final's 0.050" in targets(tmp_path)[1]


def test_a_study_of_one_method_prints_no_targets(tmp_path, quality_report):
    (tmp_path / "results.jsonl").write_text(json.dumps(
        result("opd_hybrid_kl", 0, 0.15, [(20, 0.1), (40, 0.15)], 32)) + "\n")
    quality_report.report(tmp_path)
    assert "Targets:" not in (tmp_path / "quality.md").read_text()


@pytest.fixture
def quality(quality_report, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # bench/quality.py imports quality_report
    spec = importlib.util.spec_from_file_location("quality", BENCH / "quality.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("user", [[], ["train.prompts_per_step=8"]])
def test_every_method_samples_as_many_episodes_per_step_as_the_user_asked(tmp_path, quality,
                                                                           user):
    from opd.config import load_config

    recipe = str(BENCH.parent / "recipes" / "toolcalc_confirm.yaml")
    args = quality.parse_args(["--recipe", recipe, *user])
    config = load_config(recipe, None, args.overrides)
    episodes = {}
    for method in ("kd_teacher", "opd_hybrid_kl", "rl", "opd_reward"):
        overrides = quality.run_overrides(args, config, tmp_path, method, 0, None, 10,
                                          tmp_path / method, tmp_path / "validation.jsonl",
                                          tmp_path / "teacher.jsonl")
        run = load_config(recipe, None, overrides)
        episodes[method] = run.train.prompts_per_step * run.rollout.samples_per_prompt
        if method in ("rl", "opd_reward"):  # the reward's advantage is taken over a group
            assert run.rollout.samples_per_prompt == 4
    assert set(episodes.values()) == {config.train.prompts_per_step}, episodes


def test_episodes_per_step_that_groups_cannot_split_are_refused_before_any_run(tmp_path, quality):
    recipe = str(BENCH.parent / "recipes" / "toolcalc_confirm.yaml")
    with pytest.raises(SystemExit, match=r"train.prompts_per_step=6 is not a multiple of 4: rl "):
        quality.main(["--recipe", recipe, "--methods", "kd_teacher,rl", "--out", str(tmp_path),
                      "train.prompts_per_step=6"])
    assert not (tmp_path / "results.jsonl").exists()


def test_a_swept_method_is_counted_at_the_rate_its_first_seed_picked_on_the_selection_split(
        tmp_path, quality_report, quality):
    rows = []
    for lr, selection, heldout in ((2e-3, 0.10, 0.30), (8e-3, 0.20, 0.12), (1.6e-2, 0.20, 0.5)):
        row = result("kd_teacher", 0, heldout, [(200, 0.1)], 0)
        rows.append(dict(row, lr=lr, selection_success=selection,
                         run=f"kd_teacher-lr{lr:g}-seed0"))
    rows += [dict(result("kd_teacher", seed, 0.14, [(200, 0.1)], 0), lr=lr)
             for seed in (1, 2) for lr in (8e-3, 2e-3)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    # The best selection score wins, the first listed on a tie; held-out never enters.
    assert quality.pick_lrs(tmp_path, ["kd_teacher"], 0, [2e-3, 8e-3, 1.6e-2]) == \
        {"kd_teacher": 8e-3}
    assert quality.done(tmp_path, "kd_teacher", 1, 8e-3)
    assert not quality.done(tmp_path, "kd_teacher", 1, 1.6e-2)
    quality_report.report(tmp_path)
    text = (tmp_path / "quality.md").read_text()
    # Three seeds at 8e-3 (0.12, 0.14, 0.14), none of the other rates' runs.
    assert "| kd_teacher | 3 | 0.133 ± " in text
    assert "| kd_teacher | 0.100 | **0.200** | 0.200 |" in text


def test_studies_reported_together_count_only_the_confirmation_seeds(tmp_path, quality_report):
    tuned, mix = tmp_path / "tuned", tmp_path / "mix"
    for study, method, heldout in ((tuned, "sft_teacher", 0.20), (mix, "gkd_mix", 0.25)):
        rows = [dict(result(method, seed, heldout + (0.1 if seed < 3 else 0.01 * seed), [(200, 0.1)],
                            16), lr=4e-3, run=f"{method}-lr0.004-seed{seed}")
                for seed in range(6)]
        study.mkdir()
        (study / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (study / "selected_lr.json").write_text(json.dumps(
            {method: {"lr": 4e-3, "selection_success": {"0.004": 0.3}}}))
        for seed in range(6):
            run = study / "runs" / f"{method}-lr0.004-seed{seed}"
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text("".join(
                json.dumps({"step": step, "off_policy": step % 2 == 0 or method != "gkd_mix",
                            "invalid_tool_calls": 1, "failed_tool_calls": 0, "conversations": 4,
                            "truncation_rate": 0.0}) + "\n" for step in range(1, 201)))
    quality_report.report(tmp_path / "confirm", [tuned, mix], {3, 4, 5})
    text = (tmp_path / "confirm" / "quality.md").read_text()
    # Seeds 3-5 only: 0.23/0.24/0.25 and 0.28/0.29/0.30, not the +0.1 of seeds 0-2.
    assert "| sft_teacher | 3 | 0.240 ± " in text and "| gkd_mix | 3 | 0.290 ± " in text
    assert targets(tmp_path / "confirm") == [
        "- on-policy steps mixed into the teacher's conversations (gkd_mix) 0.290 against the "
        "best teacher-data off-policy method (sft_teacher) 0.240: difference +0.050, +2.8 "
        "standard errors (target: at least +2)."]
    # The mix's on-policy steps are read from its own study's run directories.
    assert "| gkd_mix | 3 | 0.250 | 0.250 | 0.000 | 0.000 |" in text
    assert "Seeds counted: 3, 4, 5" in text


def test_a_method_in_two_studies_is_refused(tmp_path, quality_report):
    for name in ("a", "b"):
        write_study(tmp_path / name, [(50, 0.06), (200, 0.12)], rl_advantage_std=0.5)
    with pytest.raises(SystemExit, match=r"kd_teacher has results in both .*/a and .*/b; "
                                         r"report each study on its own"):
        quality_report.report(tmp_path / "both", [tmp_path / "a", tmp_path / "b"])
