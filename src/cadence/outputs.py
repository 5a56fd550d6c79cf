"""User-facing results, shaped as users of vLLM expect (`out.outputs[0].text`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cadence.boundary import RequestMetrics, TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "deadline" | "error"
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's result. `metrics` holds its timings as readings of the engine's monotonic
    clock (`time.monotonic()`), so that `ttft` and the other differences are immune to the wall
    clock being set; vLLM's `metrics.arrival_time` is Unix time, which is
    `metrics.arrival_unix_time` here (`metrics.unix_time(t)` for any other reading)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
