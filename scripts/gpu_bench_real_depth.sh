#!/usr/bin/env bash
# Issue #18's real-depth benchmark on the H200: `benchmark/bench_real_depth.py` for each shape, one process per shape
# under `timeout` (its --time-budget MARGIN seconds shorter, so the rows that started finish and the report is whole),
# the time left split evenly over the shapes still to run (a shape that finishes early leaves its time to the next).
#   OUT=./out TOTAL_BUDGET=360 bash scripts/gpu_bench_real_depth.sh
#   SHAPES="qwen3.5-9b" TOTAL_BUDGET=240 BENCH_ARGS="--reps 2" bash scripts/gpu_bench_real_depth.sh
#   SLOTS="200 80 80": seconds per shape in order (capped by what is left), instead of the even split.
# Each shape's two engine phases (prefix caching on, then off) run in processes of their own (--isolate), so a
# device fault in one cannot take the other's rows; the report merges both.
# Results: $OUT/real_depth_<shape>.md (the report, rewritten after every row) and $OUT/real_depth_<shape>.log (the
# progress log; its last line is the JSON summary); the reports are also printed at the end.
set -u
export PYTHONUNBUFFERED=1
OUT="${OUT:-./out}"
SHAPES="${SHAPES:-qwen3.5-9b qwen3.5-35b-a3b qwen3-next-80b}"
TOTAL_BUDGET="${TOTAL_BUDGET:-360}"
MARGIN="${MARGIN:-30}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
START=$SECONDS
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); $(nvidia-smi --query-gpu=name,memory.total \
    --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"

read -r -a slots <<< "${SLOTS:-}"
set -- $SHAPES
k=0
while [ $# -gt 0 ]; do
    shape=$1
    left=$((TOTAL_BUDGET - (SECONDS - START)))
    slot=$((left / $#))
    if [ -n "${slots[$k]:-}" ] && [ "${slots[$k]}" -lt "$left" ]; then
        slot=${slots[$k]}
    fi
    k=$((k + 1))
    shift
    if [ "$slot" -le "$((MARGIN + 30))" ]; then
        echo "=== $shape: skipped (${left}s of the total budget left)"
        continue
    fi
    echo "=== $shape: timeout ${slot}s, --time-budget $((slot - MARGIN))s (t=$((SECONDS - START))s)"
    timeout -k 10 "$slot" python3 benchmark/bench_real_depth.py --shape "$shape" --time-budget "$((slot - MARGIN))" \
        --out "$OUT/real_depth_$shape.md" ${BENCH_ARGS:-} > "$OUT/real_depth_$shape.log" 2>&1
    rc=$?
    echo "=== $shape: exit $rc after $((SECONDS - START))s; progress:"
    grep -a '^\[bench' "$OUT/real_depth_$shape.log" | cut -c1-300 | tail -40
    if [ "$rc" -ne 0 ]; then
        grep -av '^{"bench"' "$OUT/real_depth_$shape.log" | grep -av '^\[bench' | tail -25
    fi
done

for shape in $SHAPES; do
    if [ -f "$OUT/real_depth_$shape.md" ]; then
        echo
        cat "$OUT/real_depth_$shape.md"
    fi
done
echo "=== done in $((SECONDS - START))s"
