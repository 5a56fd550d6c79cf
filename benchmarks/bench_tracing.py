"""What OpenTelemetry tracing costs a server: output tokens/s with traces exported against none.

    .venv/bin/python benchmarks/bench_tracing.py [--concurrencies 8,32] [--rounds 2] [--out results/tracing]

Two `cadence serve` of this tree take turns (the order flips every run) under `cadence bench`'s chat
workload at each concurrency: one plain, one with `--otlp-traces-endpoint` pointing at an OTLP/HTTP
receiver this script runs (it reads each export and answers 200, as a collector would; every
request is sampled). It prints each pair's output tokens/s and their ratio, and the spans received.

Servers, client and receiver share the machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cadence.bench.launch import served

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]


class Receiver(BaseHTTPRequestHandler):
    exports = 0
    bytes_in = 0

    def do_POST(self) -> None:  # noqa: N802 (the http.server spelling)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).exports += 1
        type(self).bytes_in += len(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def one_run(traced: bool, conc: int, rnd: int, args: argparse.Namespace, receiver_port: int, out: Path) -> float:
    name = f"{'traced' if traced else 'plain'}_c{conc}_r{rnd}"
    cmd = [*CADENCE, "serve", "--port", str(args.port)]
    if traced:
        cmd += ["--otlp-traces-endpoint", f"http://127.0.0.1:{receiver_port}"]
    with served(cmd, f"http://127.0.0.1:{args.port}/health", out / f"{name}.log", cwd=ROOT, timeout=180):
        subprocess.run([*CADENCE, "bench", "--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", "chat",
                        "--workload", "chat", "--concurrency", str(conc), "--num-requests",
                        str(max(48, 6 * conc)), "--seed", str(rnd), "--no-progress", "--out", str(out / name)],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return float(json.loads((out / name / "summary.json").read_text())["overall"]["output_token_throughput"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrencies", default="8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8023)
    p.add_argument("--out", default=str(ROOT / "results/tracing"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    lines = []
    try:
        for conc in (int(c) for c in args.concurrencies.split(",")):
            ratios = []
            for rnd in range(args.rounds):
                order = (False, True) if rnd % 2 == 0 else (True, False)
                tps = {traced: one_run(traced, conc, rnd, args, httpd.server_address[1], out) for traced in order}
                ratios.append(tps[True] / tps[False])
                print(f"{conc} streams, round {rnd}: plain {tps[False]:.1f} tok/s, traced {tps[True]:.1f} tok/s, "
                      f"ratio {ratios[-1]:.3f}", flush=True)
            lines.append(f"{conc} streams: traced / plain output tok/s per round "
                         f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")
    finally:
        httpd.shutdown()
    text = "\n".join([*lines, f"the receiver got {Receiver.exports} exports, {Receiver.bytes_in} bytes"])
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
