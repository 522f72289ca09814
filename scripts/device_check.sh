#!/usr/bin/env bash
# On the device tool (H200): the test suite and the demo. Needs the transformers wheel in .whl/ (carried).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/gpu.txt
git log -1 --format=%h | tee -a $OUT/gpu.txt
timeout 250 python3 -m pytest tests -o addopts="" -q -rs -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/pytest.log
timeout 300 python3 -m dsv4kv demo 2>&1 | tee $OUT/demo.log
