"""`final/` holds the student in its training precision: a bf16 student is not exported as fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fp32_student(tmp_path_factory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=32,
                                         tie_word_embeddings=False))
    path = tmp_path_factory.mktemp("student")
    model.save_pretrained(path)
    return path


# DeepSpeed already exported its 16-bit consolidation in bf16; FSDP exported its fp32 master.
@pytest.mark.parametrize("backend", [pytest.param("deepspeed", marks=pytest.mark.slow), "fsdp"])
def test_bf16_student_is_exported_in_bf16(fp32_student, tmp_path, backend):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    final = tmp_path / "final"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "tests/dist_scripts/export_dtype.py", str(fp32_student), str(final),
         backend, "bf16"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(final / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 (not iterable)
    assert dtypes == {"BF16"}
    size = (final / "model.safetensors").stat().st_size
    assert size < 0.55 * (fp32_student / "model.safetensors").stat().st_size
    exported = AutoModelForCausalLM.from_pretrained(final)
    initial = AutoModelForCausalLM.from_pretrained(fp32_student, dtype=torch.float32)
    assert exported.dtype == torch.bfloat16
    for name, param in initial.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], param.to(torch.bfloat16),
                                   rtol=0, atol=0)
