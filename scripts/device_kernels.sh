#!/usr/bin/env bash
# On the device tool (H200): the kernel tests at GPU sizes, then compute-sanitizer memcheck over every kernel.
# Needs the transformers wheel in .whl/ (carried). Usage: bash scripts/device_kernels.sh [pytest args...]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/gpu.txt
timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest "${@:-tests}" -o addopts="" -q -rs -p no:cacheprovider --durations=15 > $OUT/pytest-full.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest-full.log | tail -40 | tee $OUT/pytest.log
if [ -n "$MEMCHECK" ]; then
    timeout ${MEMCHECK_TIMEOUT:-150} compute-sanitizer --tool memcheck --leak-check no python3 scripts/memcheck_kernels.py > $OUT/memcheck.log 2>&1
    echo "memcheck exit $?" >> $OUT/memcheck.log
    tail -30 $OUT/memcheck.log
fi
