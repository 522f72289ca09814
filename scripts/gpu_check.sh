#!/usr/bin/env bash
# A maintainer's check on a CUDA GPU (the project's H200 device machine): the test suite with the GPU tests, the
# compute-sanitizer memcheck of every kernel, the demo, and the benches of the decode step, each stage's output in
# its own log under $OUT (default /tmp/gpu_check).
#
#   bash scripts/gpu_check.sh [tests] [memcheck] [demo] [bench]          (default: tests memcheck)
#
# Wheels in .whl/ (transformers, sgl-flash-mla for `bench flashmla`) are installed with --no-deps into /tmp/site.
# tests: TESTS (default tests/) over TESTS_WORKERS pytest-xdist workers (default 8) sharing the GPU,
# one line per test (a stage cut short still names what failed), each test at most TEST_TIMEOUT s.
# bench: `dsv4kv bench <w> --runs 30` for each workload w of BENCH (default: flashmla topk decode), each at most
# BENCH_TIMEOUT s (default 300); with BASELINE=<a checkout's src folder> the same benches of that tree run
# too, each workload old then new in turn, so the two are measured in one session of the machine.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    SITE=/tmp/site:
fi
export PYTHONPATH=${SITE}$PWD/src
{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "sources $(python3 -c 'from dsv4kv.tools.bench.timing import source_digest; print(source_digest())')"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

stage() {  # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/gpu.txt"
}

for s in ${*:-tests memcheck}; do
    case $s in
    tests) stage tests "${TESTS_TIMEOUT:-420}" python3 -m pytest ${TESTS:-tests} -o addopts="" -p no:cacheprovider -rfEs \
        -n "${TESTS_WORKERS:-8}" -v --timeout "${TEST_TIMEOUT:-240}" --durations 25 ;;
    memcheck) stage memcheck "${MEMCHECK_TIMEOUT:-400}" compute-sanitizer --tool memcheck --leak-check no \
        python3 scripts/memcheck_kernels.py ;;
    demo) stage demo 300 python3 -m dsv4kv demo --no-progress ;;
    bench)
        for w in ${BENCH:-flashmla topk decode}; do
            if [ -n "${BASELINE:-}" ]; then
                PYTHONPATH=${SITE}$BASELINE stage "bench-$w-baseline" 300 \
                    python3 -m dsv4kv.cli bench "$w" --runs 30 --out "$OUT/baseline" --name "$w"
            fi
            stage "bench-$w" "${BENCH_TIMEOUT:-300}" python3 -m dsv4kv bench "$w" --runs 30 --out "$OUT/bench" --name "$w"
        done ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
    esac
done
