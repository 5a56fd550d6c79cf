"""How far the predicted time to first token is from the real one, under Poisson load.

    .venv/bin/python benchmarks/bench_predicted_ttft.py [--rates 2,4,8] [--num-requests 150]
        [--cost-profile PATH] [--out results/predicted_ttft]

Starts `cadence serve` (the default model; `--cost-profile` as given, else the shipped profile) and,
at each rate, sends `cadence bench`'s chat workload (seeded prompt and output lengths; prompts of
random token ids, so no prefix is shared; `ignore_eos`, so each request produces its workload's
output length) as Poisson arrivals. Every request streams with
`stream_options.include_queue_status`: the stream's first line is the prediction, made as the
request reached the engine. After the run it asks `GET /v1/requests/{id}` for each request's real
time to first token (on the engine's clock, from the same arrival). A few requests first warm the
server up (`--warmup`), unmeasured. Reports, per rate: the median
and p90 of |predicted - real| (seconds) and of predicted / real, and how many had no prediction.

Writes OUT/summary.json (and the server log). Server and client share the machine: run it on a
quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

from cadence.bench.launch import served
from cadence.workload import arrival_times, builtin_workload

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]
COMMENT = re.compile(r"^: queued position=(\d+) predicted_ttft_s=(\S+) state=(\w+)")
VOCAB = (100, 40000)  # token ids the prompts are drawn from (ordinary text tokens of the default model)


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def one(client: httpx.AsyncClient, at: float, t0: float, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + at - asyncio.get_running_loop().time()))
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_queue_status": True, "include_usage": False}}
    row: dict[str, Any] = {"prompt_tokens": len(prompt), "max_tokens": max_tokens}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        row["request_id"] = r.headers.get("x-request-id")
        row["status"] = r.status_code
        async for line in r.aiter_lines():
            m = COMMENT.match(line)
            if m:
                row["position"] = int(m.group(1))
                row["state_at_admission"] = m.group(3)
                row["predicted"] = None if m.group(2) == "unknown" else float(m.group(2))
    return row


async def run_rate(url: str, rate: float, n: int, seed: int) -> list[dict[str, Any]]:
    workload = builtin_workload("chat", n, seed)
    times = arrival_times(n, "poisson", rate, seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(*VOCAB) for _ in range(req.prompt_tokens)] for req in workload.requests]
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = asyncio.get_running_loop().time()
        rows = await asyncio.gather(*(one(client, at, t0, p, req.output_tokens)
                                      for at, p, req in zip(times, prompts, workload.requests, strict=True)))
        for row in rows:
            if row.get("request_id"):
                status = (await client.get(f"/v1/requests/{row['request_id']}")).json()
                row["real"] = status.get("ttft")
    return list(rows)


def warm_up(url: str, n: int, seed: int) -> None:
    """A cold server's first steps are slower than its later ones: run a few requests first."""
    rng = random.Random(f"warmup:{seed}")
    with httpx.Client(base_url=url, timeout=300) as client:
        for _ in range(n):
            prompt = [rng.randrange(*VOCAB) for _ in range(rng.randrange(16, 512))]
            client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True}).raise_for_status()


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = [(r["predicted"], r["real"]) for r in rows if r.get("predicted") is not None and r.get("real")]
    errors = [abs(p - a) for p, a in pairs]
    ratios = [p / a for p, a in pairs]
    return {
        "requests": len(rows), "predicted": len(pairs),
        "no_prediction": sum(1 for r in rows if r.get("predicted") is None),
        "real_ttft_median_s": _quantile([a for _, a in pairs], 0.5),
        "abs_error_median_s": _quantile(errors, 0.5), "abs_error_p90_s": _quantile(errors, 0.9),
        "ratio_median": _quantile(ratios, 0.5), "ratio_p90": _quantile(ratios, 0.9),
        "ratio_p10": _quantile(ratios, 0.1),
        "queued_at_admission": sum(1 for r in rows if r.get("state_at_admission") == "waiting"),
        "mean_abs_error_s": statistics.fmean(errors) if errors else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="2,4,8", help="requests per second, one run each (default %(default)s)")
    p.add_argument("--num-requests", type=int, default=150, help="requests per rate (default %(default)s)")
    p.add_argument("--cost-profile", default=None, help="the server's --cost-profile (default: the shipped one)")
    p.add_argument("--warmup", type=int, default=16,
                   help="requests sent one by one before the first rate, not measured (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8024)
    p.add_argument("--serve-args", default="", help="more `cadence serve` flags, space-separated")
    p.add_argument("--out", default=str(ROOT / "results/predicted_ttft"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*CADENCE, "serve", "--host", "127.0.0.1", "--port", str(args.port), *args.serve_args.split()]
    if args.cost_profile:
        cmd += ["--cost-profile", args.cost_profile]
    url = f"http://127.0.0.1:{args.port}"
    results: dict[str, Any] = {"command": " ".join(sys.argv), "serve": " ".join(cmd[2:]), "rates": {}}
    with served(cmd, f"{url}/health", out / "server.log", cwd=ROOT, timeout=300):
        warm_up(url, args.warmup, args.seed)
        for rate in (float(r) for r in args.rates.split(",")):
            rows = asyncio.run(run_rate(url, rate, args.num_requests, args.seed))
            s = summarize(rows)
            results["rates"][f"{rate:g}"] = {**s, "rows": rows}
            print(f"{rate:g} req/s: {s['predicted']}/{s['requests']} predicted, real TTFT median "
                  f"{_fmt(s['real_ttft_median_s'])} s; |error| median {_fmt(s['abs_error_median_s'])} s, "
                  f"p90 {_fmt(s['abs_error_p90_s'])} s; predicted/real median {_fmt(s['ratio_median'])}, "
                  f"p90 {_fmt(s['ratio_p90'])}", flush=True)
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out / 'summary.json'}")
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(main())
