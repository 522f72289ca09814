#!/usr/bin/env bash
# Creates .venv and installs dsv4kv with its test extras.
# torch: an existing install is kept (the venv sees system site-packages, so a CUDA build stays);
# otherwise a machine without an NVIDIA GPU gets the CPU build 2.13.0, and one with a GPU the default
# (CUDA) build. An unpinned `torch` on a CPU machine would pull gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if "$VPY" -c "import torch" 2>/dev/null; then
    echo "setup: keeping torch $("$VPY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch
else
    # "+cpu" matches the CPU wheel on disk (pip's find-links) on these machines; stock PyPI's Linux
    # torch==2.13.0 is the CUDA build, so elsewhere the CPU build comes from PyTorch's own index.
    "$VPY" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
        || "$VPY" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
"$VPY" -m pip install -q -e ".[triton,test]"
