#!/usr/bin/env bash
# Streaming throughput of `cadence serve` with its HTTP head limits and clocks (this tree) against the
# same tree on uvicorn's stock httptools protocol, alternating, 8 and 32 concurrent chat streams.
#   bash benchmarks/bench_http_limits.sh [ROUNDS]      (from the repository root, after `make install`)
set -u
case "${1:-}" in -h|--help) sed -n '2,4p' "$0" | cut -c3-; exit 0;; esac
cd "$(dirname "$0")/.."
PY=.venv/bin/python
ROUNDS=${1:-2}
OUT=$(mktemp -d)
cp -r src "$OUT/stock_src"
sed -i 's/        http=protocol,/        http="httptools",/' "$OUT/stock_src/cadence/server/app.py"
grep -q 'http="httptools"' "$OUT/stock_src/cadence/server/app.py" || { echo "patching the stock copy failed"; exit 1; }
for round in $(seq "$ROUNDS"); do
  sides="limits stock"; [ $((round % 2)) = 0 ] && sides="stock limits"
  for side in $sides; do
    src=$PWD/src; [ "$side" = stock ] && src=$OUT/stock_src
    PYTHONPATH=$src $PY -m cadence.cli serve --port 18611 > "$OUT/serve_$side.log" 2>&1 & pid=$!
    until curl -sf 127.0.0.1:18611/health >/dev/null; do sleep 1; done
    for c in 8 32; do
      $PY -m cadence.cli bench --base-url http://127.0.0.1:18611 --workload chat --endpoint chat --concurrency $c \
        --num-requests $((c * 4)) --max-output-tokens 128 --seed 1 --no-progress > "$OUT/r$round-$side-c$c.txt" 2>&1
      echo "round $round $side c$c: $(grep -o 'output [0-9.]* tok/s' "$OUT/r$round-$side-c$c.txt")"
    done
    kill -TERM $pid; wait $pid
  done
done
rm -rf "$OUT"
