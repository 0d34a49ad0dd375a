#!/usr/bin/env bash
# Run test files on the GPU machine (real kernels, slow tests included), split into N pytest processes side by side
# (their compiles run on the CPU cores, so N processes cut the wall time), each process cut at LIMIT seconds.
# From the repository root:
#     bash benchmarks/gpu_tests.sh N LIMIT tests/test_a.py [tests/test_b.py ...] [-k EXPR]
# Writes $OUT/gpu_tests_<i>.txt per process (or ./gpu_tests_out/ without $OUT) and prints a summary: per process
# its last pytest line, or "cut at LIMIT s" with how many of its tests had reported. Tests are dealt round-robin,
# so a cut process leaves a spread of tests unrun: give a long file more processes or two calls.
set -u
if [ $# -lt 3 ]; then
  echo "usage: bash benchmarks/gpu_tests.sh N LIMIT tests/test_x.py [more files] [-k EXPR]" >&2
  exit 2
fi
N=$1 LIMIT=$2
shift 2
cd "$(dirname "$0")/.."
DEST=${OUT:-gpu_tests_out}
mkdir -p "$DEST"
export PYTHONPATH=.:tests XLA_PYTHON_CLIENT_PREALLOCATE=false
ids=$(mktemp)
python3 -m pytest --collect-only -q -m "slow or not slow" -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$ids"
total=$(wc -l < "$ids")
echo "gpu_tests: $total tests in $N processes, each cut at $LIMIT s"
pids=()
for i in $(seq 1 "$N"); do
  mapfile -t chunk < <(awk -v n="$N" -v i="$i" '(NR - 1) % n == i - 1' "$ids")
  [ ${#chunk[@]} -eq 0 ] && continue
  timeout "$LIMIT" python3 -m pytest -q -rf -m "slow or not slow" -p no:cacheprovider "${chunk[@]}" \
    > "$DEST/gpu_tests_$i.txt" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for i in $(seq 1 "$N"); do
  f="$DEST/gpu_tests_$i.txt"
  [ -f "$f" ] || continue
  last=$(grep -E "(passed|failed|error)" "$f" | tail -1)
  if [ -z "$last" ]; then
    done_n=$(grep -oE '^[.FEsx]+' "$f" | tr -d '\n' | wc -c)
    fails=$(grep -oE '^[.FEsx]+' "$f" | tr -d '\n.sx' | wc -c)
    last="cut at $LIMIT s: $done_n tests reported, $fails failed or errored"
  fi
  echo "process $i: $last"
  grep -E "^FAILED" "$f" || true
done
rm -f "$ids"
