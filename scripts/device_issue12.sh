#!/usr/bin/env bash
# Issue 12 on the H200 (device tool: the repo is the working dir, results go to $OUT). Runs the GPU tests of the
# files the decode branch touched (top-k, the fused indexer query, the indexer, the bench) and of the layer that
# uses them, the top-k variant timings (scripts/bench_variants.py topk: the split kernel over programs per SM x tile
# columns, TOPK_GRID to pick them, and the kernel before when TOPK_BEFORE names a copy of it), `dsv4kv bench topk --quick`
# with the default --device cuda, and (stage decode) `dsv4kv bench decode --quick`; then prints a short table.
#
#   bash scripts/device_issue12.sh [tests] [variants] [bench] [decode] [sequential] [plain] [memcheck]
#   (default: tests variants bench; sequential: the decode stage with every kernel on one stream; plain: the decode
#   stage without programmatic dependent launch)
#
# Each stage has a timeout (TESTS_TIMEOUT, VARIANTS_TIMEOUT, BENCH_TIMEOUT, DECODE_TIMEOUT, MEMCHECK_TIMEOUT s) so the
# default run fits one 10-minute device call on a warm machine; run the stages in separate calls otherwise.
# The transformers wheel in .whl/ is installed when carried (test_bench's transformers hook test needs it).
set -u
OUT=${OUT:-/tmp/device_issue12}
mkdir -p "$OUT"
STAGES=${*:-tests variants bench}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD/src
else
    export PYTHONPATH=$PWD/src
fi
{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/gpu.txt" 2>&1

run_tests() {  # name, then pytest arguments
    local name=$1
    shift
    timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest "$@" -o addopts="" -q -rfEs -p no:cacheprovider \
        --durations=5 > "$OUT/pytest-$name.log" 2>&1
    echo "exit $?" >> "$OUT/pytest-$name.log"
}

for stage in $STAGES; do
    case $stage in
    tests)
        run_tests topk tests/test_kernel_topk.py
        run_tests query tests/test_kernel_query.py
        run_tests indexer tests/test_kernel_indexer.py
        run_tests bench tests/test_bench.py
        run_tests layer tests/test_kernel_layer.py
        ;;
    variants)
        timeout "${VARIANTS_TIMEOUT:-300}" python3 scripts/bench_variants.py topk > "$OUT/topk-variants.txt" 2>&1
        echo "exit $?" >> "$OUT/topk-variants.txt"
        ;;
    bench)
        timeout "${BENCH_TIMEOUT:-150}" python3 -m dsv4kv.cli bench topk --quick --runs 20 --out "$OUT/bench" \
            --name topk > "$OUT/bench-topk.txt" 2>&1
        echo "exit $?" >> "$OUT/bench-topk.txt"
        ;;
    decode)  # the CSA decode core at 16K / 1M batch 1 and 128K batch 64, per kernel
        timeout "${DECODE_TIMEOUT:-300}" python3 -m dsv4kv.cli bench decode --quick --runs 20 --out "$OUT/bench" \
            --name decode > "$OUT/bench-decode.txt" 2>&1
        echo "exit $?" >> "$OUT/bench-decode.txt"
        ;;
    sequential)  # the same decode core with every kernel on one stream (streams.CONCURRENT = False), for comparison
        timeout "${DECODE_TIMEOUT:-300}" python3 -c "import sys; from dsv4kv import streams; streams.CONCURRENT = False
from dsv4kv.cli import main; sys.exit(main(sys.argv[1:]))" bench decode --quick --runs 20 --out "$OUT/bench-seq" \
            --name decode-sequential > "$OUT/bench-decode-sequential.txt" 2>&1
        echo "exit $?" >> "$OUT/bench-decode-sequential.txt"
        ;;
    plain)  # the same decode core with plain launches (kernels.launch.DEPENDENT_LAUNCH = False), for comparison
        timeout "${DECODE_TIMEOUT:-300}" python3 -c "import sys; from dsv4kv.kernels import launch; launch.DEPENDENT_LAUNCH = False
from dsv4kv.cli import main; sys.exit(main(sys.argv[1:]))" bench decode --quick --runs 20 --out "$OUT/bench-plain" \
            --name decode-plain > "$OUT/bench-decode-plain.txt" 2>&1
        echo "exit $?" >> "$OUT/bench-decode-plain.txt"
        ;;
    memcheck)  # the changed kernels under compute-sanitizer: top-k in one and four launches, unfilled scores
        timeout "${MEMCHECK_TIMEOUT:-300}" compute-sanitizer --tool memcheck --leak-check no python3 -m pytest \
            tests/test_kernel_topk.py tests/test_kernel_indexer.py -k "gpu_batches or gpu_graph or unfilled" \
            -o addopts="" -q -p no:cacheprovider > "$OUT/memcheck.log" 2>&1
        echo "exit $?" >> "$OUT/memcheck.log"
        ;;
    *)
        echo "unknown stage $stage (tests, variants, bench, decode, sequential, plain, memcheck)" >&2
        ;;
    esac
done

# --- the table -------------------------------------------------------------------------------------------------
echo "== issue 12: $(head -1 "$OUT/gpu.txt"); $(tail -1 "$OUT/gpu.txt")"
for log in "$OUT"/pytest-*.log; do
    [ -e "$log" ] || continue
    name=$(basename "$log" .log)
    counts=$(grep -E "^[0-9]+ (passed|failed)|[0-9]+ (passed|failed|skipped|error)" "$log" | tail -1)
    printf '%-16s %s (%s)\n' "${name#pytest-}" "${counts:-no summary}" "$(tail -1 "$log")"
    grep -E "^(FAILED|ERROR)" "$log" | head -8 | sed 's/^/    /'
done
if [ -e "$OUT/topk-variants.txt" ]; then
    echo "top-k, median us (30 graph replays, L2 flushed); DIFFERS = a wrong set, not timed:"
    grep -E "^TOPK" "$OUT/topk-variants.txt" | sed 's/^TOPK/   /'
    grep -E "DIFFERS|Error|error" "$OUT/topk-variants.txt" | head -5 | sed 's/^/    /'
    tail -1 "$OUT/topk-variants.txt" | sed 's/^/    variants /'
fi
if [ -e "$OUT/bench-topk.txt" ]; then
    echo "dsv4kv bench topk --quick (default --device cuda): $(tail -1 "$OUT/bench-topk.txt")"
    grep -E "^ +topk|commit|REFUSED|targets|\[(met|MISSED)\]" "$OUT/bench-topk.txt" | head -12 | sed 's/^/  /'
fi
if [ -e "$OUT/bench-decode.txt" ]; then
    echo "dsv4kv bench decode --quick: $(tail -1 "$OUT/bench-decode.txt")"
    grep -E "  csa: core|\[(met|MISSED)\]" "$OUT/bench-decode.txt" | cut -c1-160 | sed 's/^/  /'
fi
if [ -e "$OUT/bench-decode-sequential.txt" ]; then
    echo "dsv4kv bench decode --quick, one stream: $(tail -1 "$OUT/bench-decode-sequential.txt")"
    grep -E "  csa: core" "$OUT/bench-decode-sequential.txt" | cut -c1-160 | sed 's/^/  /'
fi
if [ -e "$OUT/bench-decode-plain.txt" ]; then
    echo "dsv4kv bench decode --quick, plain launches: $(tail -1 "$OUT/bench-decode-plain.txt")"
    grep -E "  csa: core" "$OUT/bench-decode-plain.txt" | cut -c1-160 | sed 's/^/  /'
fi
if [ -e "$OUT/memcheck.log" ]; then
    echo "memcheck: $(grep -E "ERROR SUMMARY" "$OUT/memcheck.log" | tail -1) ($(tail -1 "$OUT/memcheck.log"))"
fi
