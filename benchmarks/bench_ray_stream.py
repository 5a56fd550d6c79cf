"""The CPU cost of one item streamed through a Ray Serve handle, on both sides.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_ray_stream.py [--items 2000] [--streams 8]

A deployment yields small items (each like a `StreamDelta` of one token) to this process over
`handle.options(stream=True)`: `--streams` concurrent calls of `--items` items each (one item per
stream per step, as the fleet sends 8 streams' deltas today), then one call of `--items` items
each carrying `--streams` payloads (one message per replica per step). Prints CPU microseconds
per item and per payload in this process (the caller: `cadence serve`'s side) and in the
replica's process (from /proc). Serve's env switches (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP ...) apply as set in the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from cadence.engine.output_processor import StreamDelta

TICK = os.sysconf("SC_CLK_TCK")


def _delta(i: int) -> StreamDelta:
    return StreamDelta(f"req-{i}", " tok", [i], num_prompt_tokens=100, num_output_tokens=i)


@serve.deployment(max_ongoing_requests=64)
class Streamer:
    def pid(self) -> int:
        return os.getpid()

    async def stream(self, items: int, per_item: int) -> Any:
        for i in range(items):
            yield _delta(i) if per_item == 1 else {f"req-{k}": (_delta(i),) for k in range(per_item)}
            await asyncio.sleep(0)


def _proc_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _drain(handle: Any, items: int, per_item: int) -> int:
    n = 0
    async for _ in handle.options(stream=True).stream.remote(items, per_item):
        n += 1
    return n


async def measure(handle: Any, pid: int, streams: int, items: int, per_item: int) -> tuple[float, float, float]:
    """(caller CPU s, replica CPU s, wall s) for `streams` concurrent calls of `items` items."""
    c0, r0, t0 = _self_cpu(), _proc_cpu(pid), time.perf_counter()
    got = await asyncio.gather(*(_drain(handle, items, per_item) for _ in range(streams)))
    assert sum(got) == streams * items, got
    return _self_cpu() - c0, _proc_cpu(pid) - r0, time.perf_counter() - t0


async def run(args: argparse.Namespace) -> None:
    handle = serve.run(Streamer.bind(), name="stream-bench", route_prefix=None)
    handle = handle.options()  # (a fresh handle bound to this loop)
    pid = await handle.pid.remote()
    await measure(handle, pid, args.streams, 100, 1)  # warm up
    for label, streams, per_item in (("one item per stream per step", args.streams, 1),
                                     (f"one item per step carrying {args.streams} streams", 1, args.streams)):
        caller, replica, wall = await measure(handle, pid, streams, args.items, per_item)
        n = streams * args.items
        payloads = n * per_item
        print(f"{label}: {n} items ({payloads} payloads) in {wall:.1f} s; CPU us per item: caller "
              f"{1e6 * caller / n:.0f}, replica {1e6 * replica / n:.0f}; per payload: caller "
              f"{1e6 * caller / payloads:.0f}, replica {1e6 * replica / payloads:.0f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--streams", type=int, default=8)
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 1024 * 1024)
    serve.start(proxy_location="Disabled")
    try:
        asyncio.run(run(args))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
