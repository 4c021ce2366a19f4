#!/usr/bin/env bash
# The prefix-cache benchmark's pressure axis (`lmdeploy bench prefix-cache --pressure 100,50,25`) on the H200 with a
# checkpoint of real depth: Qwen3.5-0.8B-shaped (24 layers = 18 gated DeltaNet + 6 attention, hidden 1024,
# attention 8/2 x 256, gated delta 16/16 x 128, MLP 3584), random weights, bf16; one state row is ~19 MiB. The demo
# tokenizer and chat template come with it (save_tiny_model). One bench process per workload, so a timeout keeps
# the workloads already done.
#   OUT=./out BUDGET=540 WORKLOADS="shared_system multi_turn repeat" bash scripts/gpu_bench_pressure.sh
# Results: $OUT/pressure_bench.tgz (pressure/<workload>/{report.md,hit_rate.png,pressure.png} and <workload>.log,
# whose last line is the JSON summary with `pressure_verdicts`) and $OUT/pressure_summary.txt (the verdicts).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-./out}"
MODEL_DIR="${MODEL_DIR:-/tmp/qwen3_5_08b_shape}"
BUDGET="${BUDGET:-540}"
REQUESTS="${REQUESTS:-16}"
WORKLOADS="${WORKLOADS:-shared_system multi_turn repeat branching shared_doc long_context}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fla ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT/pressure"
START=$SECONDS

python3 - "$MODEL_DIR" <<'PY'
import os
import sys

from lmdeploy.demo_model import save_tiny_model

path = sys.argv[1]
if not os.path.isfile(os.path.join(path, 'config.json')):
    save_tiny_model(path, arch='qwen3_5', dtype='bfloat16', config_overrides=dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, initializer_range=0.02))
print('model ready:', path, sorted(os.listdir(path)))
PY
echo "=== model ready (t=$((SECONDS - START))s)"

for w in $WORKLOADS; do
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 30 ]; then
        echo "=== $w: skipped (budget)"; continue
    fi
    echo "=== $w (timeout ${left}s)"
    timeout -k 5 "$left" python3 -m lmdeploy.bench prefix-cache --model "$MODEL_DIR" --device cuda --dtype bfloat16 \
        --workload "$w" --mode full --requests "$REQUESTS" --pressure 100,50,25 --json --out "$OUT/pressure/$w" \
        > "$OUT/pressure/$w.log" 2>&1
    echo "=== $w: rc=$? (t=$((SECONDS - START))s)"
    grep -E '^- (ok|FAILS):' "$OUT/pressure/$w.log" | tee -a "$OUT/pressure_summary.txt"
done
tar -czf "$OUT/pressure_bench.tgz" -C "$OUT" pressure
