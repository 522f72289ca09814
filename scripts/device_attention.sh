#!/usr/bin/env bash
# On the GPU machine: install the carried FlashMLA wheel (.whl/), then time the attention variants beside FlashMLA
# (scripts/attention_variants.py) and run the attention tests. Output under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi -L | tee $OUT/machine.txt
python3 -c "import torch, triton, flash_mla; print('torch', torch.__version__, 'triton', triton.__version__, 'flash_mla', flash_mla.__version__)" | tee -a $OUT/machine.txt
case "${1:-variants}" in
  variants) python3 scripts/attention_variants.py ${OLD:+--old $OLD} ${QUICK:+--quick} 2>&1 | tee $OUT/variants.txt ;;
  tests) python3 -m pytest tests/test_kernel_attention.py -o addopts="" -q -x -s 2>&1 | tee $OUT/pytest-attention.txt ;;
esac
