#!/usr/bin/env bash
# The prefix-cache benchmark's pressure axis (`lmdeploy bench prefix-cache --pressure 100,50,25`) on the H200 with a
# model of real depth: Qwen3.5-0.8B-shaped (24 layers = 18 gated DeltaNet + 6 attention, hidden 1024, attention
# 8/2 x 256, gated delta 16/16 x 128, MLP 3584), dummy weights (`--load-format dummy`: a config-only folder, random
# weights drawn on the device), bf16; one state row is ~19.5 MiB. The demo tokenizer and chat template come with
# the folder (save_tiny_model(weights=False)).
#
# One bench process runs the workloads in the order given (the done-when workload first), under one timeout of
# BUDGET seconds; after each workload it prints that workload's pressure table and verdicts to the log, so a run
# cut short keeps the workloads it finished. Modes at each level: full, full-lru, aligned (MODES), against the
# unbounded `full` run and the oracle. Eager mode: each of the ~10 engines per workload starts without capturing
# CUDA graphs (hit rates and outputs do not depend on them).
#   BUDGET=150 WORKLOADS=shared_system,long_context bash scripts/gpu_bench_pressure.sh
# Output: the log on stdout (per run: hit rate, cached tokens, pools, evictions by cause; per workload: the table and
# verdicts); with OUT set, $OUT/pressure/{report.md,hit_rate.png,pressure.png} and $OUT/pressure.log as well.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-}"
MODEL_DIR="${MODEL_DIR:-/tmp/qwen3_5_08b_shape}"
BUDGET="${BUDGET:-150}"
REQUESTS="${REQUESTS:-16}"
MODES="${MODES:-full-lru,aligned}"
LEVELS="${LEVELS:-100,50,25}"   # pressure levels (percent of each workload's working set)
WORKLOADS="${WORKLOADS:-shared_system,long_context,repeat,multi_turn,branching,shared_doc}"
DEVICE="${DEVICE:-cuda}"     # DEVICE=cpu DTYPE=float32: a smoke run of the script without a GPU
DTYPE="${DTYPE:-bfloat16}"
START=$SECONDS

python3 - "$MODEL_DIR" <<'PY'
import os
import sys

from lmdeploy.demo_model import save_tiny_model

path = sys.argv[1]
if not os.path.isfile(os.path.join(path, 'config.json')):
    save_tiny_model(path, arch='qwen3_5', dtype='bfloat16', weights=False, config_overrides=dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, initializer_range=0.02))
print('model folder ready:', path, sorted(os.listdir(path)))
PY
echo "=== model folder ready (t=$((SECONDS - START))s); workloads $WORKLOADS, budget ${BUDGET}s"

args=(--model "$MODEL_DIR" --load-format dummy --device "$DEVICE" --dtype "$DTYPE" --workload "$WORKLOADS" --mode full
      --requests "$REQUESTS" --max-new-tokens 6 --pressure "$LEVELS" --pressure-modes "$MODES" --eager-mode)
if [ -n "$OUT" ]; then
    mkdir -p "$OUT"
    args+=(--out "$OUT/pressure")
fi
left=$((BUDGET - (SECONDS - START)))
timeout -k 5 "$left" python3 -m lmdeploy.bench prefix-cache "${args[@]}" 2>&1 | tee ${OUT:+"$OUT/pressure.log"}
echo "=== rc=${PIPESTATUS[0]} (t=$((SECONDS - START))s; 124: the budget ran out, the tables above are the workloads done)"
