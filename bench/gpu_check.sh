#!/usr/bin/env bash
# GPU checks for a machine with one CUDA GPU, in under 5 minutes once installed: bf16 +
# flash-attn varlen step parity against SDPA, the vLLM engine on a Qwen3-architecture model
# (greedy agreement with the HF engine, sync time and log-prob gap) and rollout throughput at
# batch 64 against the HF engine. Prints JSON lines (bench/gpu_check.py). Installs into a venv
# (.venv-gpu) the CUDA torch, requirements.txt, flash-attn and vLLM (requirements-vllm-gpu.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-gpu/bin/python ]; then
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q -r requirements.txt -r requirements-vllm-gpu.txt
  .venv-gpu/bin/pip install -q --no-build-isolation -r requirements-gpu.txt \
    || echo '{"check": "flash-attn install", "skipped": "no wheel or build failed"}'
fi
timeout 300 .venv-gpu/bin/python -m bench.gpu_check
