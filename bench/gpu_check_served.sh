#!/usr/bin/env bash
# The served teacher on a machine with one CUDA GPU, in under 8 minutes once installed: a vLLM
# teacher server on the GPU beside a ZeRO-3 student, three short trainings at equal work (served
# top-64, served sampled tokens, the in-process teacher's top-64), one JSON line each: tokens/s,
# the share of step time spent waiting for the teacher, the answer's bytes per target token
# (bench/gpu_check_served.py). Uses bench/gpu_check.sh's venv (.venv-gpu), made here if absent.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu_check_served.sh needs a CUDA GPU and nvidia-smi finds none; run it on a GPU machine." >&2
  exit 1
fi
if [ ! -x .venv-gpu/bin/python ]; then
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q -r requirements.txt -r requirements-vllm-gpu.txt
fi
timeout 470 .venv-gpu/bin/python -m bench.gpu_check_served
