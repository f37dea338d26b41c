#!/usr/bin/env bash
# GPU correctness pass in one call (for the lent device machine, or any CUDA box):
#   1. the kernels' compiled tests (`-m device`), one pytest process per kernel, in parallel, the
#      LM head's split product on the GPU (tests/test_f32_matmul.py), and the batch-invariance
#      device tests (tests/test_batch_invariance.py -m device);
#   2. the model's golden tests, the engine tests and the cache-consistency tests with the
#      kernels switched on (DEEPINFER_KERNELS=auto: the GPU default);
#   3. optionally (E2E=1) scripts/bench_e2e.py once the tests are done (a quiet GPU for timing).
# $OUT (default ./device_out) gets summary.txt, logs.tgz (every log) and e2e.json; the summary
# is also printed last. EXTRA='cmd' runs one more command beside the tests (its log: extra.log).
# CHECK_GROUPS='golden engine' runs only those test groups (names: ALL_GROUPS below).
#
#   OUT=/tmp/out bash scripts/device_check.sh          # tests only
#   CHECK_GROUPS="sinkhorn_kernel golden" bash scripts/device_check.sh
#   E2E=1 bash scripts/device_check.sh                 # tests, then the end-to-end bench
#
# Time on an H200 box (16 CPU cores; compiles dominate, the groups share the CPUs): with every
# group at once the model groups and batch_invariance outran a 460 s timeout (2026-12-02);
# where one command may run at most 10 minutes, split the groups over two calls, and run E2E
# alone (`python scripts/bench_e2e.py`).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
LOGS="$(mktemp -d)/logs"
mkdir -p "$LOGS"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export DEEPINFER_KERNELS=auto
# the golden tensors ship with the checkout (tests/golden); DEEPINFER_GOLDEN overrides
TEST_TIMEOUT="${TEST_TIMEOUT:-420}"
E2E_TIMEOUT="${E2E_TIMEOUT:-240}"

run_tests() {  # name, pytest args...
  local name=$1; shift
  timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" "$@" \
    >"$LOGS/$name.log" 2>&1
  echo $? >"$LOGS/$name.rc"
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >"$LOGS/gpu.txt" 2>&1
"$PY" -c "import jax; print(jax.__version__, jax.devices())" >>"$LOGS/gpu.txt" 2>&1

ALL_GROUPS="moe_kernel sparse_kernel indexer_kernel sinkhorn_kernel f32_matmul batch_invariance golden cache_consistency engine spec_engine"
GROUPS_RUN="${CHECK_GROUPS:-$ALL_GROUPS}"
run_group() {  # one group's pytest process
  case $1 in
    moe_kernel) run_tests "$1" -m device tests/test_moe_gmm_kernel.py ;;
    sparse_kernel) run_tests "$1" -m device tests/test_sparse_attention_kernel.py ;;
    indexer_kernel) run_tests "$1" -m device tests/test_indexer_topk_kernel.py ;;
    sinkhorn_kernel) run_tests "$1" -m device tests/test_sinkhorn_kernel.py ;;
    f32_matmul) run_tests "$1" tests/test_f32_matmul.py ;;
    batch_invariance) run_tests "$1" -m device -s tests/test_batch_invariance.py ;;
    # the model's tests with the kernels on, one process per file (together they outran 460 s)
    golden) run_tests "$1" -m "not slow" -rs tests/test_golden.py ;;
    cache_consistency) run_tests "$1" -m "not slow" -rs tests/test_cache_consistency.py ;;
    engine) run_tests "$1" -m "not slow" -rs tests/test_engine.py ;;
    # DSpark in the engine: greedy with speculation == without, plain steps between verification steps
    spec_engine) run_tests "$1" -m "not slow" -rs tests/test_spec_engine.py ;;
    *) echo "unknown group $1 (groups: $ALL_GROUPS)" >"$LOGS/$1.log"; echo 2 >"$LOGS/$1.rc" ;;
  esac
}
for g in $GROUPS_RUN; do
  run_group "$g" &
done
if [ -n "${EXTRA:-}" ]; then
  (timeout "$TEST_TIMEOUT" bash -c "$EXTRA" >"$LOGS/extra.log" 2>&1; echo $? >"$LOGS/extra.rc") &
fi
wait

if [ "${E2E:-0}" = 1 ]; then
  timeout "$E2E_TIMEOUT" "$PY" scripts/bench_e2e.py --out "$OUT/e2e.json" >"$LOGS/e2e.log" 2>&1
  echo $? >"$LOGS/e2e.rc"
fi

{
  echo "== summary"
  cat "$LOGS/gpu.txt"
  for f in "$LOGS"/*.rc; do
    n=$(basename "$f" .rc)
    printf '%-18s rc=%s  %s\n' "$n" "$(cat "$f")" "$(grep -E '(passed|failed|error)' "$LOGS/$n.log" | tail -1)"
  done
  for n in $GROUPS_RUN; do
    grep -E '^(FAILED|ERROR|SKIPPED)' "$LOGS/$n.log" | head -12
  done
  [ -f "$LOGS/e2e.log" ] && grep -v "it/s\|tensor/s" "$LOGS/e2e.log" | tail -15
} >"$OUT/summary.txt" 2>&1
tar -czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" logs
cat "$OUT/summary.txt"
exit 0
