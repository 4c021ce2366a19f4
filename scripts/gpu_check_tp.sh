#!/usr/bin/env bash
# The two-GPU tensor-parallel check (issue 24), run from the repo root on a machine with at least two GPUs
# (the `nvidia-h200-x2` kind):
#   (a) the GPUs, torch / NCCL versions; NVLink multicast off for every process (the engine sets it too);
#   (b) the CPU tensor-parallel tests (gloo) and the two-GPU ones (NCCL, CUDA graphs)  -> $OUT/tp_tests.log
#   (c) benchmark/bench_tp.py, TP=1 against TP=2 on the Qwen3.5-27B shape (dummy bf16 weights)
#                                                                                       -> $OUT/bench_tp.txt
#   (d) benchmark/bench_tp.py --fit-80b: a Qwen3-Next-80B shape with all 512 experts at TP=2 -> $OUT/fit_80b.txt
#   (e) a summary of the steps that failed; always exits 0.
# Time limits (seconds, overridable): TESTS_TIMEOUT=300 BENCH_TIMEOUT=540 FIT_TIMEOUT=420.
# BENCH_ARGS: extra arguments for the benchmark (e.g. `--layers 16 --cold 8192` for a shorter run).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-./out}"
mkdir -p "$OUT"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-300}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-540}"
FIT_TIMEOUT="${FIT_TIMEOUT:-420}"
declare -a SUMMARY=()

note() {  # note NAME RC
    local verdict="ok"
    if [ "$2" -eq 124 ] || [ "$2" -eq 137 ]; then verdict="TIMEOUT (rc $2)"; elif [ "$2" -ne 0 ]; then verdict="FAILED (rc $2)"; fi
    SUMMARY+=("$1: $verdict")
    echo "== $1: $verdict"
}

nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 | tee "$OUT/gpus.txt"
python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())' 2>&1 | tee -a "$OUT/gpus.txt"

timeout "$TESTS_TIMEOUT" python -m pytest -q -p no:cacheprovider \
    tests/engine/test_tensor_parallel.py tests/engine/test_tensor_parallel_cuda.py > "$OUT/tp_tests.log" 2>&1
note "tensor-parallel tests (gloo + NCCL)" $?
tail -5 "$OUT/tp_tests.log"

# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT" python benchmark/bench_tp.py --tp 1 2 ${BENCH_ARGS:-} > "$OUT/bench_tp.txt" 2>&1
note "bench_tp TP=1 vs TP=2" $?
grep -v ' INFO ' "$OUT/bench_tp.txt" | tail -25

timeout "$FIT_TIMEOUT" python benchmark/bench_tp.py --fit-80b --tp 2 > "$OUT/fit_80b.txt" 2>&1
note "Qwen3-Next-80B shape at TP=2" $?
grep -v ' INFO ' "$OUT/fit_80b.txt" | tail -8

echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
exit 0
