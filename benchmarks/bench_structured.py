"""What structured output costs the engine, on the default model.

    .venv/bin/python benchmarks/bench_structured.py [--rows 32] [--rounds 3] [--tokens 48]

Measures:
  step time   decode steps of `rows` requests all under a JSON schema against the same rows
              unconstrained (temperature 1, same prompts and lengths); median step time of the
              decode-only steps of each run, best of `rounds` alternating runs, and their ratio
              (goal: at most 1.10)
  mask fill   of that: the time the engine core spends filling the step's batched bitmask
  compile     a typical schema's compile time, cold (a new compiler) and cached

OMP_WAIT_POLICY defaults to PASSIVE (see bench_runner.py for why). On a shared machine, read the
ratio, which the alternating rounds protect, rather than the absolute times.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP below

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from cadence.config import EngineConfig  # noqa: E402
from cadence.engine.builder import Engine, build_engine  # noqa: E402
from cadence.request import Request, SamplingParams, StructuredOutputsParams  # noqa: E402
from cadence.structured.compiler import GrammarCompiler  # noqa: E402

# A typical extraction schema; its strings are long enough that no row finishes within the run.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 400},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"enum": ["work", "home", "other"]}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]},
        "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
    },
    "required": ["name", "age", "email", "tags", "address", "score"],
    "additionalProperties": False,
}


def run(engine: Engine, rows: int, tokens: int, constrained: bool, tag: str) -> tuple[float, float]:
    """Median decode-only step time and median mask-fill time (seconds) of one run of `rows` requests."""
    core = engine.core
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as a JSON object with a long name."}])
    for i in range(rows):
        p = SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=not constrained, structured_outputs=so)
        core.add_request(Request(f"{tag}-{i}", list(prompt), p))
    structured = core.structured
    fill = structured.with_bitmask
    fills: list[float] = []

    def timed(out):  # noqa: ANN001, ANN202 - the core's own call, timed
        t = time.perf_counter()
        res = fill(out)
        fills.append(time.perf_counter() - t)
        return res

    structured.with_bitmask = timed  # type: ignore[method-assign]
    steps: list[float] = []
    try:
        while core.has_unfinished_requests():
            t = time.perf_counter()
            core.step()
            dt = time.perf_counter() - t
            it = core.last_stats
            if it.num_prompt_tokens == 0 and it.num_generation_tokens == rows:
                steps.append(dt)
    finally:
        del structured.with_bitmask
    return statistics.median(steps), statistics.median(fills) if fills else 0.0


def compile_times(engine: Engine) -> tuple[float, float]:
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    spec = StructuredOutputsParams(json=SCHEMA)
    t = time.perf_counter()
    compiler.compile(spec)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile(spec)
    cached = time.perf_counter() - t
    compiler.shutdown()
    return cold, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    engine = build_engine(EngineConfig.from_options(max_num_seqs=args.rows, max_num_batched_tokens=4096))
    cold, cached = compile_times(engine)
    run(engine, args.rows, 8, True, "warm-c")  # first use: the grammar library and the kernels load
    run(engine, args.rows, 8, False, "warm-u")
    plain, constrained, fills = [], [], []
    for r in range(args.rounds):
        plain.append(run(engine, args.rows, args.tokens, False, f"u{r}")[0])
        step, fill = run(engine, args.rows, args.tokens, True, f"c{r}")
        constrained.append(step)
        fills.append(fill)
    result = {
        "rows": args.rows,
        "step_ms_unconstrained": round(min(plain) * 1e3, 2),
        "step_ms_constrained": round(min(constrained) * 1e3, 2),
        "ratio": round(min(constrained) / min(plain), 3),
        "mask_fill_ms": round(min(fills) * 1e3, 2),
        "compile_ms_cold": round(cold * 1e3, 2),
        "compile_ms_cached": round(cached * 1e3, 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
