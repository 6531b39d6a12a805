"""The served-teacher recipes: a user moves a recipe from the in-process teacher to a served one
by changing its teacher section only, and `--dry-run` prints both sides' memory: the student's
per rank, the teacher's per teacher GPU (opd/backends/memory.py, `served_teacher_memory`), from config.json
shapes alone (tests/test_memory_estimate.config_only, tests/fixtures/models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from opd.config import load_config
from opd.pipeline import dry_run
from opd.plugins import resolve_plugins
from tests.test_memory_estimate import config_only, size

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = REPO / "configs" / "clusters"
QWEN3_235B = REPO / "tests" / "fixtures" / "models" / "Qwen3-235B-A22B"
V = 151936


def memory_lines(config) -> list[str]:
    out = dry_run(config, resolve_plugins(config))
    return out[out.index("\nmemory per rank"):out.index("\ncode this recipe")].splitlines()[2:]


def training_peak_gib(lines: list[str]) -> float:
    line = next(line for line in lines if line.startswith("  device peak per rank: training "))
    return float(line.split("training ")[1].split(" GiB")[0])


@pytest.mark.parametrize("recipe, cluster, student, teacher", [
    ("qwen3_8b_to_1.7b", "qwen3-8xh100", "Qwen3-1.7B", "Qwen3-8B"),
    ("qwen3_32b_to_4b", "qwen3-4x8xh100", "Qwen3-4B", "Qwen3-32B"),
])
def test_swapping_the_teacher_section_alone_moves_a_recipe_to_a_served_teacher(
        tmp_path, recipe, cluster, student, teacher):
    in_process_path = REPO / "recipes" / f"{recipe}.yaml"
    tree = yaml.safe_load(in_process_path.read_text())
    served_section = yaml.safe_load(
        (REPO / "recipes" / "qwen3_32b_to_8b_served.yaml").read_text())["teacher"]
    served_path = tmp_path / f"{recipe}_served.yaml"
    served_path.write_text(yaml.safe_dump({**tree, "teacher": served_section}, sort_keys=False))
    models = [f"model.student={config_only(tmp_path, student)}",
              f"model.teacher={config_only(tmp_path, teacher)}"]
    in_process = load_config(in_process_path, CLUSTERS / f"{cluster}.yaml", models)
    served = load_config(served_path, CLUSTERS / f"{cluster}.yaml", models)
    assert served.teacher.engine == "served" and in_process.teacher.engine != "served"
    assert {k: v for k, v in vars(served).items() if k != "teacher"} == \
        {k: v for k, v in vars(in_process).items() if k != "teacher"}

    before, after = memory_lines(in_process), memory_lines(served)
    student_lines = [line for line in before if not line.startswith(("  teacher", "    AutoTP"))]
    assert student_lines[:5] == after[:5]  # the student's states and micro-batch, unchanged
    assert before[5].startswith("  teacher: ") and in_process.teacher.engine in before[5]
    assert after[5].startswith("  teacher: ") and "served: 1 server(s) of tp 4 outside this " \
        "job (teacher.urls; launch/teacher_server.sh --tensor-parallel-size)" in after[5]
    assert after[6].startswith("    per teacher GPU: weights ")
    # Without the teacher on the trainer's ranks, their peak is the student's alone.
    assert training_peak_gib(after) < training_peak_gib(before)


def test_the_32b_served_recipe_prints_the_hand_formula_per_teacher_gpu(tmp_path):
    config = load_config(REPO / "recipes" / "qwen3_32b_to_8b_served.yaml",
                         CLUSTERS / "qwen3-served-4x8xh100.yaml",
                         [f"model.student={config_only(tmp_path, 'Qwen3-8B')}",
                          f"model.teacher={config_only(tmp_path, 'Qwen3-32B')}"])
    lines = memory_lines(config)
    n = 32_762_123_264  # Qwen3-32B (tests/test_memory_estimate.by_hand)
    tp, ranks, in_flight, length = 4, 24, 4, 4096
    kv_token = 64 * 2 * (8 // tp) * 128 * 2
    weights, kv, logits = n * 2 / tp, ranks * in_flight * length * kv_token, 2 * 8192 * V * 4 / tp
    assert lines[6] == (
        f"    per teacher GPU: weights {size(weights)} + KV cache 64 KiB per token, {size(kv)} for "
        f"{ranks * in_flight} conversations in flight ({ranks} ranks x teacher.in_flight="
        f"{in_flight}) of {length} tokens + prompt log-probs {size(logits)} (fp32 logits and "
        "log-softmax of a 8192-token prefill chunk)")
    assert lines[5].startswith("  teacher: 32762.1M parameters, served: 2 server(s) of tp 4 on "
                               "the job's 1 teacher node(s) (2 per node, cluster.teacher_nodes)")
    assert f"teacher GPU peak: {size(weights + kv + logits)} of the " \
           "teacher.gpu_memory_utilization=0.9 share" in lines[7]


def test_the_235b_served_recipe_fits_one_teacher_node_in_fp8(tmp_path, monkeypatch):
    pytest.importorskip("bfcl_eval", reason="the BFCL extra (requirements-bfcl.txt)")
    monkeypatch.setenv("OPD_CACHE_DIR", str(tmp_path / "cache"))  # a dry run prepares nothing
    config = load_config(REPO / "recipes" / "qwen3_235b_a22b_served.yaml",
                         CLUSTERS / "qwen3-235b-served-3x8xh100.yaml",
                         [f"model.student={config_only(tmp_path, 'Qwen3-4B')}",
                          f"model.teacher={QWEN3_235B}"])
    lines = memory_lines(config)
    # 94 layers of attention (64 q / 4 kv heads of 128, q/k norms), 128 experts of 3 x 4096 x
    # 1536, a router and two norms; an embedding and a head of 151,936 x 4096; the final norm.
    layer = 2 * 4096 * 8192 + 2 * 4096 * 512 + 2 * 128 + 128 * 3 * 4096 * 1536 + 4096 * 128 \
        + 2 * 4096
    n = 94 * layer + 2 * V * 4096 + 4096
    assert lines[5].startswith(f"  teacher: {n / 1e6:.1f}M parameters, served: 1 server(s) of "
                               "tp 8 on the job's 1 teacher node(s)")
    assert "fp8 weights, expert parallel" in lines[5]
    weights = n * 1 / 8  # fp8
    kv_token = 94 * 2 * 1 * 128 * 2  # 4 kv heads over tp 8: one per GPU
    kv, logits = 16 * 2 * 24576 * kv_token, 2 * 8192 * V * 4 / 8
    assert lines[6].startswith(f"    per teacher GPU: weights {size(weights)} + KV cache 47 KiB "
                               f"per token, {size(kv)} for 32 conversations")
    peak = weights + kv + logits
    assert peak < 0.9 * 80e9  # inside vLLM's share of an H100 80GB
    assert f"teacher GPU peak: {size(peak)} of the" in lines[7]
