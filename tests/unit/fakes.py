"""Shared test helpers: a deterministic fake executor over a simulated paged KV cache, and factories.

The fake writes every fed token into the slot its block table maps it to and reads the whole
context back through the block table before "sampling". The sampled token is a function of
that context only, so a run that chunks, preempts or hits the prefix cache must produce exactly
the tokens of a plain run; a wrong block table or a stale prefix hit changes them (and is
recorded in `violations`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from cadence.boundary import ModelOutput, RequestDelta, ScheduledRequest, SchedulerOutput
from cadence.clock import VirtualClock
from cadence.config import EngineConfig
from cadence.engine.core import EngineCore
from cadence.request import Request, SamplingParams

VOCAB = 1000
_ids = itertools.count()


def next_token(context: list[int], vocab: int = VOCAB) -> int:
    """A deterministic 'model': depends on every token and its position."""
    h = len(context)
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return h % vocab


class FakeExecutor:
    """Implements the Executor protocol; records every SchedulerOutput it is given.

    `script[request_id]` lists tokens to return for that request's outputs in order (then the
    deterministic function takes over); `fail_steps` makes execute raise on those step numbers;
    `step_cost(out)` seconds are added to `clock` (when given) per execute.
    """

    def __init__(
        self,
        *,
        bytes_per_token: int = 64,
        script: dict[str, list[int]] | None = None,
        fail_steps: Iterable[int] = (),
        clock: VirtualClock | None = None,
        step_cost: float = 0.01,
        cost_per_token: float = 0.0,
        verify_kv: bool = True,
    ) -> None:
        self.bytes_per_token = bytes_per_token
        self.script = dict(script or {})
        self.fail_steps = set(fail_steps)
        self.clock = clock
        self.step_cost = step_cost
        self.cost_per_token = cost_per_token
        self.verify_kv = verify_kv
        self.outputs: list[SchedulerOutput] = []
        self.violations: list[str] = []
        self.num_blocks = 0
        self.block_size = 0
        self._slots: list[list[int]] = []

    def kv_bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._slots = [[-1] * block_size for _ in range(num_blocks)]

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.outputs.append(out)
        if self.clock is not None:
            self.clock.advance(self.step_cost + self.cost_per_token * out.num_batched_tokens)
        if out.step in self.fail_steps:
            raise RuntimeError(f"scripted failure at step {out.step}")
        sampled: dict[str, int] = {}
        verified: dict[str, tuple[int, ...]] = {}
        for sr in out.scheduled:
            if self.verify_kv:
                self._write(sr.block_table, sr.start_pos, sr.token_ids, sr.request_id)
            if not sr.sample:
                continue
            if sr.num_draft_tokens:
                verified[sr.request_id] = self._verify(sr)
                continue
            scripted = self.script.get(sr.request_id, [])
            if sr.num_output_tokens < len(scripted):
                sampled[sr.request_id] = scripted[sr.num_output_tokens]
            elif self.verify_kv:
                sampled[sr.request_id] = next_token(self._read(sr.block_table, sr.end_pos, sr.request_id))
            else:
                sampled[sr.request_id] = (sr.end_pos * 7 + sr.token_ids[-1]) % VOCAB
        return ModelOutput(sampled_token_ids=sampled, verified_token_ids=verified)

    def _target(self, sr: ScheduledRequest, i: int) -> int:
        """The token this fake picks after position start_pos + i of a verification row."""
        scripted = self.script.get(sr.request_id, [])
        if sr.num_output_tokens + i < len(scripted):
            return scripted[sr.num_output_tokens + i]
        end = sr.start_pos + i + 1
        return next_token(self._read(sr.block_table, end, sr.request_id)) if self.verify_kv \
            else (end * 7 + sr.token_ids[i]) % VOCAB

    def _verify(self, sr: ScheduledRequest) -> tuple[int, ...]:
        """Greedy verification, as the real sampler does it: targets at every position of the row."""
        out = [self._target(sr, 0)]
        for i, draft in enumerate(sr.draft_token_ids, start=1):
            if draft != out[-1]:
                break
            out.append(self._target(sr, i))
        return tuple(out)

    def _write(self, table: tuple[int, ...], start: int, tokens: tuple[int, ...], rid: str) -> None:
        bs = self.block_size
        for i, tok in enumerate(tokens):
            pos = start + i
            if pos // bs >= len(table):
                self.violations.append(f"{rid}: position {pos} beyond its block table")
                return
            self._slots[table[pos // bs]][pos % bs] = tok

    def _read(self, table: tuple[int, ...], end: int, rid: str) -> list[int]:
        bs = self.block_size
        context = [self._slots[table[p // bs]][p % bs] for p in range(end)]
        if -1 in context:
            self.violations.append(f"{rid}: read a slot that was never written")
        return context


def make_request(
    prompt_len: int = 8,
    max_tokens: int = 4,
    *,
    rid: str | None = None,
    prompt: list[int] | None = None,
    params: SamplingParams | None = None,
    **fields,
) -> Request:
    """A request with a prompt unlikely to share a prefix with any other (unless `prompt` is given)."""
    n = next(_ids)
    rid = rid if rid is not None else f"r{n}"
    if prompt is None:
        prompt = [(n * 7919 + i * 31) % (VOCAB - 1) + 1 for i in range(prompt_len)]
    params = params if params is not None else SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), params, **fields)


def make_engine(
    *, max_model_len: int = 4096, executor: FakeExecutor | None = None, decode_ids: bool = False, **options
) -> tuple[EngineCore, FakeExecutor, VirtualClock]:
    """An EngineCore on a virtual clock with the integrity check after every step (`decode_ids`:
    see `EngineCore`)."""
    options.setdefault("num_kv_blocks", 64)
    options.setdefault("block_size", 4)
    clock = VirtualClock(1.0)
    executor = executor if executor is not None else FakeExecutor(clock=clock)
    if executor.clock is None:
        executor.clock = clock
    engine = EngineCore(
        EngineConfig.from_options(**options), executor, clock=clock, max_model_len=max_model_len, check_integrity=True,
        decode_ids=decode_ids,
    )
    return engine, executor, clock


def run_until_done(engine: EngineCore, max_steps: int = 10_000) -> dict[str, list[RequestDelta]]:
    """Step until nothing is unfinished; returns every delta per request."""
    deltas: dict[str, list[RequestDelta]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    raise AssertionError(f"not done after {max_steps} steps")


def tokens_of(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def generate_alone(prompt: list[int], max_tokens: int, **options) -> list[int]:
    """Reference output: the request run by itself on a roomy engine."""
    options.setdefault("num_kv_blocks", 256)
    engine, _, _ = make_engine(**options)
    req = make_request(prompt=prompt, max_tokens=max_tokens)
    engine.add_request(req)
    return tokens_of(run_until_done(engine)[req.request_id])
