#!/usr/bin/env bash
# The prefix-cache benchmark (`lmdeploy bench prefix-cache`) on the H200 with the Qwen3-Next-shaped checkpoint of
# benchmark/bench_vs_transformers.py: every workload in every mode, one process per workload so a timeout keeps the
# workloads already done. Builds the checkpoint if MODEL_DIR holds none, and copies the demo model's tokenizer and
# chat template next to it (the random-weight checkpoint has none; the workloads need a chat template).
#   OUT=./out MODEL_DIR=/tmp/qwen3next_bench BUDGET=540 REQUESTS=16 MODES=all bash scripts/gpu_bench_prefix.sh
# Results: $OUT/prefix_bench.tgz holding prefix_bench/<workload>/{report.md,hit_rate.png} and <workload>.log (last
# line: JSON summary; merge them with scripts/merge_prefix_bench.py), plus $OUT/prefix_bench_summary.txt (the device
# tool returns at most 8 files, none deeper than two folders, so the tree travels as one archive).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-./out}"
MODEL_DIR="${MODEL_DIR:-/tmp/qwen3next_bench}"
BUDGET="${BUDGET:-540}"
REQUESTS="${REQUESTS:-16}"
WORKLOADS="${WORKLOADS:-multi_turn repeat branching shared_doc long_context}"
EXTRA="${EXTRA:-}"
MODES="${MODES:-all}"          # e.g. off,aligned,exact,full
DEVICE="${DEVICE:-cuda}"   # DEVICE=cpu SMOKE=1: a CPU dry run on the tiny smoke-sized checkpoint
SMOKE="${SMOKE:-0}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fla ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT/prefix_bench"
START=$SECONDS

python3 - "$MODEL_DIR" "$SMOKE" <<'PY'
import os
import shutil
import sys

sys.path.insert(0, 'benchmark')
import torch  # noqa: E402

import bench_vs_transformers as bvt  # noqa: E402
from lmdeploy.demo_model import get_demo_model_path  # noqa: E402

model_dir, smoke = sys.argv[1], sys.argv[2] == '1'
config = bvt.SMOKE_CONFIG if smoke else bvt.FULL_CONFIG
if not bvt._reusable(model_dir, config):
    bench = bvt.Bench(bvt.parse_args(['--model-dir', model_dir] + (['--smoke'] if smoke else [])))
    model = bvt.build_checkpoint(bench, config, torch.float32 if smoke else torch.bfloat16)
    del model
demo = get_demo_model_path('qwen3_5')
for name in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
    if os.path.exists(os.path.join(demo, name)):
        shutil.copy(os.path.join(demo, name), os.path.join(model_dir, name))
print('model ready:', model_dir, sorted(os.listdir(model_dir)))
PY
echo "=== model ready (t=$((SECONDS - START))s)"

for w in $WORKLOADS; do
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 30 ]; then
        echo "=== $w: skipped (budget)"; continue
    fi
    echo "=== $w (timeout ${left}s)"
    # shellcheck disable=SC2086
    timeout -k 5 "$left" python3 -m lmdeploy.bench prefix-cache --model "$MODEL_DIR" --device "$DEVICE" --workload "$w" \
        --mode "$MODES" --requests "$REQUESTS" --out "$OUT/prefix_bench/$w" --json $EXTRA > "$OUT/prefix_bench/$w.log" 2>&1
    echo "=== $w: rc $? (t=$((SECONDS - START))s)"
    grep "^\[bench\]" "$OUT/prefix_bench/$w.log"
done

{
    for w in $WORKLOADS; do
        [ -f "$OUT/prefix_bench/$w.log" ] && grep '^\[bench\]' "$OUT/prefix_bench/$w.log"
    done
} > "$OUT/prefix_bench_summary.txt"
tar czf "$OUT/prefix_bench.tgz" -C "$OUT" prefix_bench && rm -rf "$OUT/prefix_bench"
cat "$OUT/prefix_bench_summary.txt"
