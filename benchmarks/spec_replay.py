"""Speculative decoding in model time: bench_speculative.py's workloads replayed through the real
engine and scheduler, each step priced by the step-cost profile, drafts verified against a real
model's recorded greedy outputs.

    .venv/bin/python benchmarks/spec_replay.py                       # record once (results/spec_replay), then replay
    .venv/bin/python benchmarks/spec_replay.py --k 8 --streams 64    # another cell, from the same recording
    .venv/bin/python benchmarks/spec_replay.py --max-num-batched-tokens 256

Greedy output does not depend on timing or batching (docs/speculative.md, Exactness), so each
request's output is generated once with the real model (`LLM(...)`, the default model unless
`--model`) and kept in `--out`/recording.json; it is made again only when the workload's settings
change. bench_speculative.py's workloads, with its seeds: `grounded@1` (its grounded requests,
each `--grounded-output-tokens` long) and the chat mix at each of `--streams` (round r: seed
`--seed` + r; at N streams max(`--num-requests`, 2N) requests), each user of the closed loop
sending its next request when its last one ends.

The replay runs those requests through `EngineCore` with `SimExecutor` (the simulator's executor)
priced by `--profile` (default: the shipped `default_2threads.json`, what `cadence serve` prices
adaptive k with at two threads), each step's tokens answered from the recording: a row's token is
the recorded output at its index, and a verification row keeps exactly the drafts that match the
recorded continuation. Every request's replayed output is checked against its recording. Per cell
and mode (speculation off, fixed k, adaptive k) it prints output tokens per modelled second, mean
TPOT, their ratios to off, the acceptance (accepted over verified draft tokens, as /metrics counts
it) and the mean k per verification row; then the ratios' medians over the rounds, also written to
`--out`/replay.md.

The figures are modelled, not measured: the profile's mean step times, no client or server
overhead, no scatter. They say what the scheduler's choices are worth by the model it decides with.
As a check that the replay verifies drafts as the real runs did, it compares fixed k's acceptance
with the one bench_speculative.py measured (`MEASURED_ACCEPTANCE`) and exits 1 if it is off by more
than `ACCEPTANCE_TOLERANCE`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cadence.boundary import ModelOutput, SchedulerOutput
from cadence.clock import VirtualClock
from cadence.config import EngineConfig
from cadence.engine.core import EngineCore
from cadence.executor.cost_model import SimExecutor, StepCostModel
from cadence.request import Request, SamplingParams
from cadence.sim.profile import shipped_profile
from cadence.sim.simulator import sim_max_model_len

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_speculative import MODES, grounded_requests  # noqa: E402 (a sibling script)

# Fixed k's acceptance that bench_speculative.py measured at k 4 on the default model (accepted
# over verified draft tokens, from /metrics): grounded@1 63%, chat@1 seed 0 33%.
MEASURED_ACCEPTANCE = {("grounded@1", 0): 0.63, ("chat@1", 0): 0.33}
ACCEPTANCE_TOLERANCE = 0.08


@dataclass(frozen=True)
class Recorded:
    """One request of a workload and the model's greedy output for it (EOS included where it stopped)."""

    prompt: tuple[int, ...]
    max_tokens: int
    output: tuple[int, ...]


@dataclass
class Recording:
    settings: dict
    eos_token_ids: frozenset[int]
    workloads: dict[str, list[Recorded]] = field(default_factory=dict)


# -- recording -------------------------------------------------------------------------------------

def _settings(args: argparse.Namespace) -> dict:
    streams = [int(s) for s in args.streams.split(",") if s]
    chat = max([args.num_requests, *(2 * s for s in streams)]) if streams else 0
    return {"model": "tiny" if args.tiny else args.model, "grounded_requests": args.num_requests, "grounded_output_tokens":
            args.grounded_output_tokens, "chat_requests": chat, "seeds": [args.seed + r for r in range(args.rounds)],
            "max_output_tokens": args.max_output_tokens}


def _covers(have: dict, want: dict) -> bool:
    """A recording of these settings serves those: the same, or more of the chat mix's requests
    (the chat mix of n requests is the first n of a longer one)."""
    return {**have, "chat_requests": 0} == {**want, "chat_requests": 0} and have["chat_requests"] >= want["chat_requests"]


def _conversations(settings: dict, out: Path, encode) -> dict[str, list[tuple[list[dict], int]]]:
    """Each workload's conversations and output lengths, as bench_speculative.py sends them."""
    from cadence.bench.prompts import PromptBuilder
    from cadence.workload import builtin_workload

    clamp = settings["max_output_tokens"] or 1 << 30
    path = out / "grounded.jsonl"
    grounded_requests(path, settings["grounded_requests"], settings["grounded_output_tokens"])
    work = {"grounded": [(r["messages"], min(r["output_tokens"], clamp))
                         for r in map(json.loads, path.read_text().splitlines())]}
    if settings["chat_requests"]:
        for seed in settings["seeds"]:
            w = builtin_workload("chat", settings["chat_requests"], seed)
            texts = PromptBuilder(encode, seed).build_all(w)
            work[f"chat/{seed}"] = [([{"role": "user", "content": t or ""}], min(r.output_tokens, clamp))
                                    for r, t in zip(w.requests, texts, strict=True)]
    return work


class _EngineTokenizer:
    """The served model's tokenizer as the prompt builder wants it (what the server's /tokenize gives)."""

    def __init__(self, tok) -> None:
        self.name, self._tok = "the model's", tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, True))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def record(settings: dict, out: Path) -> Recording:
    """Generate every workload's greedy outputs with the real model (one batch per workload)."""
    from cadence import LLM

    tiny = settings["model"] == "tiny"
    llm = LLM(None if tiny else settings["model"], tiny=tiny, num_threads=2)  # as bench_speculative.py serves
    work = _conversations(settings, out, _EngineTokenizer(llm.tokenizer))
    rec = Recording(settings, frozenset(llm.tokenizer.eos_token_ids))
    for name, convs in work.items():
        prompts = [llm.encode_chat(msgs) for msgs, _ in convs]
        params = [SamplingParams(temperature=0.0, max_tokens=n) for _, n in convs]
        outs = llm.generate(prompts, params, use_tqdm=False)
        rec.workloads[name] = [Recorded(tuple(p), n, tuple(o.outputs[0].token_ids))
                               for p, (_, n), o in zip(prompts, convs, outs, strict=True)]
        print(f"recorded {name}: {len(convs)} requests, {sum(len(r.output) for r in rec.workloads[name])} output tokens",
              flush=True)
    return rec


def save(rec: Recording, path: Path) -> None:
    path.write_text(json.dumps({"settings": rec.settings, "eos_token_ids": sorted(rec.eos_token_ids),
                                "workloads": {k: [[list(r.prompt), r.max_tokens, list(r.output)] for r in v]
                                              for k, v in rec.workloads.items()}}))


def load(path: Path) -> Recording:
    d = json.loads(path.read_text())
    return Recording(d["settings"], frozenset(d["eos_token_ids"]),
                     {k: [Recorded(tuple(p), n, tuple(o)) for p, n, o in v] for k, v in d["workloads"].items()})


# -- replay ----------------------------------------------------------------------------------------

class RecordedAnswers:
    """A step's tokens from the recorded outputs: row i's sampled token is output i of its request;
    a verification row keeps the drafts that equal the recorded continuation, then the recorded
    token after them (as greedy verification by the real model does)."""

    def __init__(self) -> None:
        self.outputs: dict[str, tuple[int, ...]] = {}

    def __call__(self, out: SchedulerOutput) -> ModelOutput:
        sampled: dict[str, int] = {}
        verified: dict[str, tuple[int, ...]] = {}
        for r in out.scheduled:
            if not r.sample:
                continue
            rec, n = self.outputs[r.request_id], r.num_output_tokens
            m = 0
            while m < r.num_draft_tokens and r.draft_token_ids[m] == _at(rec, n + m):
                m += 1
            sampled[r.request_id] = _at(rec, n + m)
            if r.num_draft_tokens:
                verified[r.request_id] = (*r.draft_token_ids[:m], sampled[r.request_id])
        return ModelOutput(sampled_token_ids=sampled, verified_token_ids=verified)


def _at(output: tuple[int, ...], i: int) -> int:
    # Past the recording's end (drafts matched up to its EOS): the engine drops what follows a stop.
    return output[i] if i < len(output) else output[-1]


@dataclass
class Outcome:
    tokens: int
    seconds: float
    tpot: float  # mean over requests of (last token - first token) / (tokens - 1)
    rows: int  # verification rows
    draft_tokens: int
    accepted: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_k(self) -> float | None:
        return self.draft_tokens / self.rows if self.rows else None


def replay(requests: Sequence[Recorded], streams: int, mode: str, args: argparse.Namespace,
           cost_model: StepCostModel, eos: frozenset[int]) -> Outcome:
    """`requests` through a closed loop of `streams` users, in model time."""
    spec = None if mode == "off" else {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": mode == "adaptive",
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    options = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    config = EngineConfig.from_options(speculative_config=spec, **options)
    clock = VirtualClock(0.0)
    answers = RecordedAnswers()
    core = EngineCore(config, SimExecutor(cost_model, clock=clock, answer=answers), clock=clock,
                      max_model_len=sim_max_model_len(None, cost_model), eos_token_ids=eos)
    core.scheduler.step_cost = cost_model.predict  # as `cadence serve` gives adaptive k its profile
    core.scheduler.step_cost_prices_shared = cost_model.prices_shared_context
    queue = deque(enumerate(requests))
    got: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    tpots: list[float] = []
    rows = drafted = accepted = 0

    def send() -> None:
        i, r = queue.popleft()
        rid = str(i)
        answers.outputs[rid] = r.output
        got[rid] = []
        core.add_request(Request(rid, list(r.prompt), SamplingParams(temperature=0.0, max_tokens=r.max_tokens),
                                 arrival_time=clock.now()))

    for _ in range(min(streams, len(queue))):
        send()
    while core.has_unfinished_requests():
        deltas = core.step()
        now, ls = clock.now(), core.last_stats
        rows, drafted, accepted = rows + ls.num_drafts, drafted + ls.num_draft_tokens, accepted + ls.num_accepted_tokens
        for d in deltas:
            if d.new_token_ids:
                first.setdefault(d.request_id, now)
                got[d.request_id].extend(d.new_token_ids)
            if d.finished:
                want = answers.outputs[d.request_id]
                if tuple(got[d.request_id]) != want:
                    raise AssertionError(f"request {d.request_id} ({mode}): the replay's output differs from the "
                                         f"recording at token {_first_difference(got[d.request_id], want)}")
                if len(want) > 1:
                    tpots.append((now - first[d.request_id]) / (len(want) - 1))
                if queue:
                    send()
    tokens = sum(len(t) for t in got.values())
    return Outcome(tokens, clock.now(), statistics.fmean(tpots) if tpots else float("nan"), rows, drafted, accepted)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def cells(rec: Recording, args: argparse.Namespace) -> list[tuple[str, int, int, list[Recorded]]]:
    """(cell, streams, round, requests) of every cell to replay."""
    out = [("grounded@1", 1, 0, rec.workloads["grounded"])]
    for rnd, seed in enumerate(rec.settings["seeds"]):
        for s in (int(x) for x in args.streams.split(",") if x):
            out.append((f"chat@{s}", s, rnd, rec.workloads[f"chat/{seed}"][: max(args.num_requests, 2 * s)]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="chat rounds: round r replays seed + r (default %(default)s)")
    p.add_argument("--num-requests", type=int, default=16,
                   help="requests per single-stream cell; at N streams at least 2N (default %(default)s)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default %(default)s)")
    p.add_argument("--grounded-output-tokens", type=int, default=256,
                   help="output tokens of each grounded request (default %(default)s)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="clamp every workload's output lengths")
    p.add_argument("--streams", default="1,8,32", help="chat mix concurrencies (default %(default)s; \"\" for none)")
    p.add_argument("--seed", type=int, default=0, help="round r uses seed + r (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's token budget per step (default: the engine's)")
    p.add_argument("--profile", default=str(shipped_profile("default-2threads")),
                   help="the step-cost profile that prices steps and adaptive k's choices (default %(default)s)")
    p.add_argument("--model", default=None, help="the model to record with (default: the default model)")
    p.add_argument("--tiny", action="store_true", help="record with the tiny random model (a check that it runs)")
    p.add_argument("--out", default=str(ROOT / "results/spec_replay"), help="recording and table (default %(default)s)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(args)
    path = out / "recording.json"
    rec = load(path) if path.is_file() else None
    if rec is None or not _covers(rec.settings, settings):
        rec = record(settings, out)
        save(rec, path)
    cost_model = StepCostModel.load(args.profile)
    header = ["| cell | round | mode | tok/s (modelled) | TPOT ms (modelled) | x tok/s | x TPOT | acceptance | mean k |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines = list(header)
    print("\n".join(header), flush=True)
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    failed = []
    for cell, streams, rnd, reqs in cells(rec, args):
        got = {mode: replay(reqs, streams, mode, args, cost_model, rec.eos_token_ids) for mode in MODES}
        off = got["off"]
        for mode in MODES:
            o = got[mode]
            rt, rp = o.tok_s / off.tok_s, o.tpot / off.tpot
            ratios.setdefault((cell, mode), []).append((rt, rp))
            row = (f"| {cell} | {rnd} | {mode} | {o.tok_s:.1f} | {o.tpot * 1000:.1f} | {rt:.3f} | {rp:.3f} | "
                   f"{_fmt(o.acceptance, '.1%')} | {_fmt(o.mean_k, '.2f')} |")
            lines.append(row)
            print(row, flush=True)
        measured = MEASURED_ACCEPTANCE.get((cell, rec.settings["seeds"][rnd] if cell != "grounded@1" else 0))
        acc = got["fixed"].acceptance
        if measured is not None and args.k == 4 and rec.settings["model"] is None and (acc is None or abs(acc - measured) > ACCEPTANCE_TOLERANCE):
            failed.append(f"{cell} round {rnd}: fixed k's acceptance {_fmt(acc, '.1%')}, measured {measured:.0%}")
    summary = ["", "| cell | mode | median x tok/s | median x TPOT | per round x tok/s |", "|---|---|---|---|---|"]
    for (cell, mode), rs in ratios.items():
        if mode != "off":
            summary.append(f"| {cell} | {mode} | {statistics.median(r for r, _ in rs):.3f} | "
                         f"{statistics.median(q for _, q in rs):.3f} | {', '.join(f'{r:.3f}' for r, _ in rs)} |")
    (out / "replay.md").write_text("\n".join(lines + summary) + "\n")
    print("\n".join(summary))
    for f in failed:
        print(f"check failed: {f} (tolerance {ACCEPTANCE_TOLERANCE:.0%})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
