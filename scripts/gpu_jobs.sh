#!/usr/bin/env bash
# The whole gpu suite in parallel processes plus timed benchmarks, on one H200, within one device call.
#   Phase 1: one job per gpu test file (long files split by -k; lines "name|timeout|command" of $JOBS if given,
#            else generated here), P at a time; ENVP is prefixed to every generated command (e.g.
#            ENVP="LMDEPLOY_FUSED_PREFILL=0", the off path); EXTRA_JOBS adds lines of another jobs file.
#            (job commands may hold single quotes and pipes, not double quotes)
#   Phase 2: benchmarks from $BENCH_LIST (lines "name timeout command"), one at a time, while LIMIT seconds last.
# Writes few files (the device returns only a handful): $OUT/summary.txt (one line per job), $OUT/all.txt (each
# failed job's tail, FULL=1: every job's), $OUT/benches.txt (each benchmark's log tail, a failed one's longer) and
# $OUT/reports.md (the reports the benchmark commands wrote with --out, this run's only). Run from the repo root:
#   OUT=./out P=14 EXTRA_JOBS=scripts/gpu_pending_jobs.txt BENCH_LIST=scripts/gpu_pending_benches.txt LIMIT=580 \
#       bash scripts/gpu_jobs.sh
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-./out}"
mkdir -p "$OUT/j"
T0=$SECONDS  # LIMIT counts from here: the wheels' install and the fla check are inside the device call's limit too
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
# the hybrid prefill graphs need an fla-core that takes precomputed chunk indices (0.6.0 on): stop before any job
# rather than time eager prefills (H100 runs 58-60 carried 0.5.2)
python3 -c 'from lmdeploy.pytorch.backends.cuda import fla_version, fla_takes_chunk_indices as ok
print("fla-core", fla_version()); raise SystemExit(0 if ok() else "fla-core >= 0.6.0 needed: carry its wheel in .whl/")' \
  || exit 1
stamp() { echo "=== [$((SECONDS - T0))s] $*"; }

make_jobs() {  # every gpu test file as a job, long ones split by -k
  local py="python3 -m pytest -q -m gpu --tb=short -rs -p no:cacheprovider -o addopts=''" t=${T:-250} f n
  for f in $(grep -l 'mark.gpu' tests/*/test_*.py); do
    n=$(basename "$f" .py)
    case $n in
      test_cuda_kernels_ops)
        echo "${n}_moe|$t|${ENVP:-} $py $f -k moe"
        echo "${n}_rest|$t|${ENVP:-} $py $f -k 'not moe'";;
      test_cuda_gated_delta_rule)   # fla autotunes every chunked key (35-85 s a case under load)
        echo "$n|$((t + 200))|${ENVP:-} $py $f --durations=8";;
      test_lora_models) echo "$n|$t|${ENVP:-} $py -s $f";;
      *) echo "$n|$t|${ENVP:-} $py $f";;
    esac
  done
}

jobs_file="$OUT/jobs.txt"
if [ -n "${JOBS:-}" ]; then cp "$JOBS" "$jobs_file"; else make_jobs > "$jobs_file"; fi
[ -n "${EXTRA_JOBS:-}" ] && grep -v '^#' "$EXTRA_JOBS" | grep . >> "$jobs_file"
stamp "jobs: $(wc -l < "$jobs_file")"
grep -v '^#' "$jobs_file" | grep . | xargs -P "${P:-12}" -d '\n' -I{} bash -c 'l="{}"; n=${l%%|*}; r=${l#*|}; t=${r%%|*}; c=${r#*|}; timeout -k 5 $t bash -c "$c" > '"$OUT"'/j/$n.txt 2>&1; echo "rc=$?" >> '"$OUT"'/j/$n.txt'
stamp "jobs done"
for f in "$OUT"/j/*.txt; do
  echo "##### $(basename "$f" .txt) $(grep -E '(passed|failed|error|no tests ran)' "$f" | tail -1) $(tail -1 "$f")"
done | tee "$OUT/summary.txt"
for f in "$OUT"/j/*.txt; do
  echo "##### $(basename "$f" .txt)"
  if grep -q '^rc=0' "$f" && [ -z "${FULL:-}" ]; then tail -3 "$f"; else grep -vE 'Warning|warnings.warn' "$f" | tail -"${TAIL:-120}"; fi
done > "$OUT/all.txt"
rm -rf "$OUT/j" "$jobs_file"

[ -n "${BENCH_LIST:-}" ] && while read -r name t cmd; do
  [ -z "$name" ] || [ "${name:0:1}" = "#" ] && continue
  left=$(( ${LIMIT:-585} - (SECONDS - T0) - 10 ))  # 10 s for timeout's kill grace and the log's copy
  if [ "$left" -lt 30 ]; then stamp "$name SKIPPED (only ${left}s left)"; continue; fi
  [ "$t" -gt "$left" ] && t=$left
  stamp "$name ($t s)"
  timeout -k 5 "$t" bash -c "$cmd" > "$OUT/b.log" 2>&1
  rc=$?
  stamp "$name done (rc=$rc)"
  # one file for every benchmark's log tail and one for their reports (the device returns only a handful of files);
  # a command without --out reports on its output: its last 150 lines are kept
  report=$(echo "$cmd" | sed -n 's/.*--out \([^ ]*\).*/\1/p')
  lines=4; [ "$rc" = 0 ] || lines=80; [ -n "$report" ] || lines=150
  { echo "##### $name rc=$rc"; tail -"$lines" "$OUT/b.log"; } >> "$OUT/benches.txt"
  [ -n "$report" ] && [ -f "$report" ] && { echo "##### $name: $report"; cat "$report"; } >> "$OUT/reports.md"
  rm -f "$OUT/b.log"
done < "$BENCH_LIST"
stamp end
