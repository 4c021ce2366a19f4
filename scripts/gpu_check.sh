#!/usr/bin/env bash
# One GPU check, run from the repo root on the H200:
#   (a) install the carried wheels (.whl/*.whl, e.g. fla-core + einops) into /tmp/site, if any;
#   (b) print the GPU, torch / triton / transformers versions and whether fla imports;
#   (c0) optional (GRAPH_OPS_TIMEOUT > 0): scripts/diagnose_graph_ops.py -> $OUT/graph_ops.txt
#   (c) the GPU test suite (pytest -m gpu)                     -> $OUT/gpu_tests.log
#   (d) benchmark/bench_copy_packed_cache.py                   -> $OUT/bench_copy.txt
#       benchmark/bench_vs_transformers.py                     -> $OUT/bench_vs_transformers.{md,log}
#   (e) a summary of the steps that failed; always exits 0.
# The package is imported from the repo root through PYTHONPATH (it is not pip-installed there).
# SKIP_WHEEL_INSTALL=1: use /tmp/site as it is (two checks at once must not install into it concurrently).
# GPU_TEST_WORKERS: pytest-xdist workers for the tests, spread over the visible GPUs (default 1: no xdist).
# VS_ARGS: extra arguments for the vs-transformers bench (e.g. `--decode-batches 64` to measure a subset).
# Time limits (seconds, overridable): TESTS_TIMEOUT=240 COPY_TIMEOUT=60 VS_TIMEOUT=240; the vs-transformers bench
# stops starting new measurements after VS_BUDGET (default VS_TIMEOUT - 40) so it still prints its table and JSON.
set -u

export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
OUT="${OUT:-./out}"
mkdir -p "$OUT"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-240}"
COPY_TIMEOUT="${COPY_TIMEOUT:-60}"
VS_TIMEOUT="${VS_TIMEOUT:-240}"
VS_BUDGET="${VS_BUDGET:-$((VS_TIMEOUT - 40))}"

START=$SECONDS
declare -a SUMMARY=()
FAILED=0

note() {  # note NAME RC [detail]
    local name=$1 rc=$2 detail=${3:-}
    local verdict
    if [ "$rc" -eq 0 ]; then
        verdict="ok"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        verdict="TIMEOUT (rc $rc)"; FAILED=$((FAILED + 1))
    else
        verdict="FAILED (rc $rc)"; FAILED=$((FAILED + 1))
    fi
    SUMMARY+=("$(printf '%-22s %s%s' "$name" "$verdict" "${detail:+  $detail}")")
    echo "=== $name: $verdict (t=$((SECONDS - START))s)"
}

# ---- (a) wheels -------------------------------------------------------------------------------------------------
echo "=== (a) wheels"
if [ -n "${SKIP_WHEEL_INSTALL:-}" ]; then  # installed already (e.g. by a caller running two checks at once)
    echo "SKIP_WHEEL_INSTALL set: using /tmp/site as it is"
    export PYTHONPATH="/tmp/site:$PWD"
elif [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    ls .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    rc=$?
    export PYTHONPATH="/tmp/site:$PWD"
    note "install wheels" "$rc"
else
    echo "no .whl/ folder: nothing to install"
    export PYTHONPATH="$PWD"
fi
echo "PYTHONPATH=$PYTHONPATH"

# ---- (b) environment --------------------------------------------------------------------------------------------
echo "=== (b) environment"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L
else
    echo "nvidia-smi not found"
fi
python3 - <<'EOF'
import importlib
import sys

print('python', sys.version.split()[0])
for name in ('torch', 'triton', 'transformers', 'fla', 'einops', 'causal_conv1d', 'lmdeploy'):
    try:
        mod = importlib.import_module(name)
        print(f'{name:14s} {getattr(mod, "__version__", "?"):12s} {getattr(mod, "__file__", "")}')
    except Exception as exc:  # report, never fail
        print(f'{name:14s} NOT IMPORTABLE: {type(exc).__name__}: {exc}')
try:
    import torch
    print('cuda available:', torch.cuda.is_available(), '| torch cuda', torch.version.cuda)
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        print(f'device: {torch.cuda.get_device_name()}, {free / 2**30:.1f} / {total / 2**30:.1f} GiB free')
except Exception as exc:
    print('torch cuda query failed:', exc)
EOF
note "environment" "$?"

# ---- (c0) optional: CUDA-graph replay of each piece of a hybrid decode step (GRAPH_OPS_TIMEOUT > 0 runs it) -------
GRAPH_OPS_TIMEOUT="${GRAPH_OPS_TIMEOUT:-0}"
if [ "$GRAPH_OPS_TIMEOUT" -gt 0 ]; then
    echo "=== (c0) diagnose_graph_ops (timeout ${GRAPH_OPS_TIMEOUT}s)"
    timeout -k 10 "$GRAPH_OPS_TIMEOUT" python3 scripts/diagnose_graph_ops.py --dtype float32 2>&1 \
        | grep -v 'Writing model shards' | tee "$OUT/graph_ops.txt"
    note "graph ops diagnostic" "${PIPESTATUS[0]}" "$(grep -c DIFFERS "$OUT/graph_ops.txt" || true) piece(s) differ"
fi

# ---- (c) GPU tests ----------------------------------------------------------------------------------------------
echo "=== (c) GPU tests (timeout ${TESTS_TIMEOUT}s)"
# Only the files that hold `gpu` tests: the others may import packages the GPU machine lacks (openai, hypothesis).
# GPU_TEST_FILES / GPU_TEST_K (a pytest -k expression) select a part, to split the suite over two device runs.
GPU_TEST_FILES="${GPU_TEST_FILES:-$(grep -l 'pytest.mark.gpu' tests/test_*.py tests/*/test_*.py | tr '\n' ' ')}"
GPU_TEST_K="${GPU_TEST_K:-}"
echo "files: $GPU_TEST_FILES"
# GPU_TEST_WORKERS > 1: pytest-xdist workers, one per GPU in turn (tests/conftest.py reads LMDEPLOY_TEST_GPUS).
GPU_TEST_WORKERS="${GPU_TEST_WORKERS:-1}"
XDIST_ARGS=""
if [ "$GPU_TEST_WORKERS" -gt 1 ]; then
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        LMDEPLOY_TEST_GPUS="$CUDA_VISIBLE_DEVICES"
    else
        LMDEPLOY_TEST_GPUS=$(nvidia-smi -L | awk 'NR > 1 { printf "," } { printf NR - 1 }')
    fi
    export LMDEPLOY_TEST_GPUS
    XDIST_ARGS="-n $GPU_TEST_WORKERS"
    echo "xdist: $GPU_TEST_WORKERS workers over GPUs $LMDEPLOY_TEST_GPUS"
fi
# shellcheck disable=SC2086
timeout -k 10 "$TESTS_TIMEOUT" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts='' --durations=25 \
    $XDIST_ARGS ${GPU_TEST_K:+-k "$GPU_TEST_K"} --continue-on-collection-errors $GPU_TEST_FILES 2>&1 \
    | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
tests_line=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/gpu_tests.log" | tail -n 1)
if [ "$rc" -eq 5 ]; then
    tests_line="no GPU tests collected; $tests_line"
fi
note "gpu tests" "$rc" "$tests_line"
grep -E '^(FAILED|ERROR) ' "$OUT/gpu_tests.log" | head -n 40 > "$OUT/gpu_tests_failures.txt" || true

# ---- (d) benchmarks ---------------------------------------------------------------------------------------------
echo "=== (d1) bench_copy_packed_cache (timeout ${COPY_TIMEOUT}s)"
timeout -k 10 "$COPY_TIMEOUT" python3 benchmark/bench_copy_packed_cache.py 2>&1 | tee "$OUT/bench_copy.txt"
note "bench copy" "${PIPESTATUS[0]}"

echo "=== (d2) bench_vs_transformers (timeout ${VS_TIMEOUT}s, budget ${VS_BUDGET}s)"
# shellcheck disable=SC2086
timeout -k 10 "$VS_TIMEOUT" python3 benchmark/bench_vs_transformers.py --out "$OUT/bench_vs_transformers.md" \
    --time-budget "$VS_BUDGET" ${VS_ARGS:-} 2>&1 | tee "$OUT/bench_vs_transformers.log"
rc=${PIPESTATUS[0]}
vs_detail=""
if [ -f "$OUT/bench_vs_transformers.md" ]; then
    n_err=$(grep -c '^- `' "$OUT/bench_vs_transformers.md" || true)
    n_no=$(grep -c '| NO |$' "$OUT/bench_vs_transformers.md" || true)
    vs_detail="measurement errors: ${n_err:-0}, targets missed: ${n_no:-0} (see bench_vs_transformers.md)"
fi
note "bench vs transformers" "$rc" "$vs_detail"

# ---- (e) summary ------------------------------------------------------------------------------------------------
{
    echo "=== summary (${SECONDS}s total, $FAILED step(s) failed)"
    for line in "${SUMMARY[@]}"; do
        echo "  $line"
    done
    if [ -s "$OUT/gpu_tests_failures.txt" ]; then
        echo "  failing tests:"
        sed 's/^/    /' "$OUT/gpu_tests_failures.txt"
    fi
} | tee "$OUT/summary.txt"
exit 0
