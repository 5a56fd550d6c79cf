"""Requests and their sampling parameters.

`Request` is owned and mutated by the scheduler alone; everything that crosses a boundary
(to the executor, to the stream) is a frozen value built from it. One progress counter,
`num_computed_tokens` (tokens whose KV is in the cache), replaces prefill and decode phases.
"""

from __future__ import annotations

import enum
import json as _json
from dataclasses import dataclass, field, replace
from functools import cached_property

from cadence.checks import is_finite, is_int

# Caps that keep one request from asking the engine for unbounded work.
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_N = 16
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 16

# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by a
# smaller one overflows, and 1e-300 is 0.0 in float32.
SAMPLING_EPS = 1e-5
# Repetition penalties outside [MIN, MAX]: a seen token's logit divided by less than 0.01 only ever
# forces repetition, and one near 0 (1e-300 is 0.0 in float32) turns logits into inf and NaN.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0


class RequestStatus(enum.IntEnum):
    """Ordered: every status >= FINISHED_STOPPED is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_DEADLINE = 6
    FINISHED_ERROR = 7
    FINISHED_EVICTED = 8  # dropped from the waiting queue for a fairer arrival (`error` says why)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _STATUS_TO_REASON.get(self)


class FinishReason(str, enum.Enum):
    """Why a request ended; the value is what the OpenAI API reports."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    DEADLINE = "deadline"
    ERROR = "error"
    EVICTED = "evicted"  # never reported as a finish: the client gets the refusal in `error`


_STATUS_TO_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_DEADLINE: FinishReason.DEADLINE,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_EVICTED: FinishReason.EVICTED,
}


def _check(cond: bool, name: str, why: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {why}")


def _token_key(k: object) -> int:
    """A logit_bias key: an int, or its decimal string (JSON objects have string keys)."""
    if is_int(k):
        return k
    if isinstance(k, str) and k.strip().lstrip("-").isdigit():
        return int(k)
    raise ValueError(k)


def _canonical(schema: object, keep_order: bool = False) -> object:
    """A JSON schema with its keys sorted, except those of a `properties` object (see below)."""
    if isinstance(schema, dict):
        keys = list(schema) if keep_order else sorted(schema, key=str)
        return {k: _canonical(schema[k], k == "properties" and not keep_order) for k in keys}
    if isinstance(schema, list):
        return [_canonical(v) for v in schema]
    return schema


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's `StructuredOutputsParams`): exactly one
    of a JSON schema (`json`, kept as canonical JSON text so that equal schemas share one compiled
    grammar), any JSON object (`json_object`), a regular expression, a list of choices, or a
    grammar. The keys of `properties` keep their order, the others are sorted: properties are
    generated in schema order, which a prompt may rely on (reasoning before the answer). Checked
    here for shape only; whether the grammar library accepts it is checked when
    it is compiled, before the request reaches the engine."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", _json.dumps(_canonical(self.json), separators=(",", ":")))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        _check(sum(given) == 1, "structured_outputs", "give exactly one of json, json_object, regex, choice, grammar")
        _check(self.json is None or isinstance(self.json, str), "structured_outputs.json",
               "must be a JSON schema (an object or its JSON text)")
        _check(isinstance(self.json_object, bool), "structured_outputs.json_object", "must be True or False")
        _check(self.regex is None or isinstance(self.regex, str), "structured_outputs.regex", "must be a string")
        _check(self.grammar is None or isinstance(self.grammar, str), "structured_outputs.grammar",
               "must be a string")
        _check(self.choice is None or (len(self.choice) > 0 and all(isinstance(c, str) for c in self.choice)),
               "structured_outputs.choice", "must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (ValueError names the field).

    A temperature below SAMPLING_EPS (0 included) means greedy. top_k <= 0 and top_p == 1 and
    min_p == 0 switch those filters off. `allowed_token_ids`, when given, are the only tokens that
    may be sampled (not with `structured_outputs`, which restricts them too). `seed` makes a
    request's samples reproducible whatever else shares its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    speculative: bool = True  # False: never speculate for this request (where the engine speculates)

    def __post_init__(self) -> None:
        # Accept lists/dicts from callers but store hashable tuples; anything else is refused here,
        # naming the field, rather than failing later as "'int' object is not iterable".
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        else:
            raise ValueError(f"stop: must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        elif isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        else:
            raise ValueError(f"stop_token_ids: must be a list of token ids, got {self.stop_token_ids!r}")
        allowed = self.allowed_token_ids
        if isinstance(allowed, (list, tuple)):
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        elif allowed is not None:
            raise ValueError(f"allowed_token_ids: must be a list of token ids, got {allowed!r}")
        bias = self.logit_bias
        if bias is None:
            bias = ()
        elif isinstance(bias, dict):
            try:
                bias = tuple((_token_key(k), v) for k, v in bias.items())
            except (TypeError, ValueError):
                raise ValueError("logit_bias: keys must be token ids (integers or their decimal strings)") from None
        elif isinstance(bias, (list, tuple)):
            if not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in bias):
                raise ValueError("logit_bias: must be a dict {token_id: bias} or a list of (token_id, bias) pairs")
            bias = tuple((e[0], e[1]) for e in bias)
        else:
            raise ValueError(f"logit_bias: must be a dict {{token_id: bias}}, got {bias!r}")
        object.__setattr__(self, "logit_bias", bias)
        self._validate()

    def _validate(self) -> None:
        _check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        _check(is_finite(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(is_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(is_int(self.top_k) and self.top_k >= -1, "top_k", "must be an integer >= -1 (0 or -1: off)")
        _check(is_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(
            is_finite(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(is_finite(v) and -2.0 <= v <= 2.0, name, "must be in [-2, 2]")
        _check(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed", "must be in [0, 2^63)"
        )
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN, "stop", f"each stop string must have 1 to {MAX_STOP_STRING_LEN} characters")
        _check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]")
        _check(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
        for tok, bias in self.logit_bias:
            _check(is_int(tok) and tok >= 0, "logit_bias", "keys must be non-negative token ids")
            _check(is_finite(bias) and -100.0 <= bias <= 100.0, "logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids",
                   f"must list 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
            _check(all(is_int(t) and t >= 0 for t in ids), "allowed_token_ids", "must be non-negative token ids")
        _check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams")
        # Two hard masks whose intersection may turn out empty partway through the output, with no
        # token left to sample: refused up front, as the server refuses the pair.
        _check(self.allowed_token_ids is None or self.structured_outputs is None, "allowed_token_ids",
               "cannot be combined with structured_outputs (both restrict the tokens that may be sampled, and "
               "together they may leave none; give one of them)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            _check(isinstance(getattr(self, name), bool), name, f"must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @cached_property
    def needs_history(self) -> bool:
        """True when sampling depends on the tokens seen so far (penalties). Cached: the scheduler
        asks once per request per step, and the params are frozen."""
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @cached_property
    def plain_decode(self) -> bool:
        """True when a decode step needs only the last token and returns only the next one: no
        history and no logprobs, so its token may come back as an id rather than a delta and the
        simulator may fast-forward it. Cached like `needs_history`."""
        return not self.needs_history and self.logprobs is None and self.structured_outputs is None

    @cached_property
    def speculable(self) -> bool:
        """True when speculative decoding may run for this request: nothing makes a position's
        token depend on more than its logits and the sampling filters (no logprobs, penalties,
        bias, allowed tokens or grammar). min_tokens is checked per step by the scheduler."""
        return self.speculative and self.plain_decode and not self.logit_bias and self.allowed_token_ids is None


PREFILL_LEG = "prefill"
DECODE_LEG = "decode"


@dataclass(frozen=True)
class HandOff:
    """One engine's part of a request served by two (disaggregated prefill and decode), so that
    their metrics together count it once. Set by the disaggregated fleet's ingress only.

    `leg` "prefill": the engine runs the request to its first token and the request goes on
    elsewhere; ended at its token limit, it is not a finished request here. `leg` "decode": the
    engine continues it from its prompt and the `num_emitted` output tokens another engine
    streamed: its prompt is no new prompt work, and its first token here is the request's next,
    not its first. The `since_*` are seconds before the engine takes the request (measured by the
    ingress, so free of the two engines' clocks): since the request arrived, since it was first
    scheduled (on the prefill engine), and since its first token (the prefill leg's one token)."""

    leg: str
    num_emitted: int = 0
    since_arrival: float = 0.0
    since_scheduled: float = 0.0
    since_first_token: float = 0.0

    def later(self, seconds: float) -> HandOff:
        """The same hand-off `seconds` later (the time a replica spent before submitting it)."""
        return replace(self, since_arrival=self.since_arrival + seconds,
                       since_scheduled=self.since_scheduled + seconds,
                       since_first_token=self.since_first_token + seconds)


@dataclass(frozen=True)
class RequestPolicy:
    """How the engine weighs one client request against the others, as it arrives: its `priority`
    (lower is served first), its `tenant` (fair share, per-tenant caps and metrics), its
    `deadline` in seconds from submission (None: none), and its prefix-cache salt (None: the
    tenant's under tenant isolation, else none). Travels whole from the server to the engine.
    `handoff`: which part of a request served by two engines this is (None: the whole request)."""

    priority: int = 0
    tenant: str = "default"
    deadline: float | None = None
    cache_salt: str | None = None
    handoff: HandOff | None = None


DEFAULT_POLICY = RequestPolicy()


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it. Mutated by the scheduler only.
    Two requests are equal only if they are the same object (the scheduler finds them by identity).

    `num_computed_tokens` counts tokens of `all_token_ids` whose KV is in the cache. A request is
    in prefill while that is below `num_prompt_tokens`; after a preemption (recompute) it is reset
    to 0 and the prompt plus the outputs so far are computed again. The last sampled token is never
    in the cache yet, so a decoding request has `num_computed_tokens == num_tokens - 1`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0
    tenant: str = "default"
    deadline: float | None = None  # absolute time on the engine clock
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None  # prefix-cache isolation (per tenant when asked)
    handoff: HandOff | None = None  # one engine's part of a request served by two (its metrics)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # of the latest output token (inter-token latency)
    finished_time: float | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    error: str | None = None
    retry_after: float | None = None  # seconds, for a request that ended refused (evicted)
    queued_step: int = 0  # the first scheduler step that may admit it (since it last joined the queue)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without concatenating the prompt and the outputs."""
        prompt = self.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return prompt[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request can ever occupy: the prompt plus every token it may generate."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason
