"""The offline Python API, shaped as users of vLLM expect.

    from cadence import LLM, SamplingParams
    llm = LLM(max_num_seqs=32)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from cadence.config import EngineConfig
from cadence.engine.builder import Engine, build_engine
from cadence.engine.output_processor import OutputProcessor, StreamDelta
from cadence.errors import AdmissionError, ErrorKind
from cadence.outputs import CompletionOutput, RequestOutput
from cadence.request import Request, RequestStatus, SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """An engine for offline batches: every prompt is queued at once and the scheduler batches them."""

    def __init__(self, model: str | None = None, *, tiny: bool = False, **engine_options: Any) -> None:
        config = EngineConfig.from_options(model=model, **engine_options)
        self.engine: Engine = build_engine(config, tiny=tiny)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        tenant: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in the prompts' order."""
        items = _as_prompt_list(prompts)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]
        texts = [p if isinstance(p, str) else None for p in items]
        return self._run(token_lists, texts, sampling_params, use_tqdm, priority, tenant)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if not messages:
            raise ValueError("messages: must not be empty")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        token_lists = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True, chat_template=chat_template)
            for c in convs
        ]
        return self._run(token_lists, [None] * len(token_lists), sampling_params, use_tqdm, None, None)

    # -- the loop ----------------------------------------------------------------------------

    def _run(self, token_lists, texts, sampling_params, use_tqdm, priority, tenant) -> list[RequestOutput]:
        params = _as_params_list(sampling_params, len(token_lists))
        results: list[RequestOutput] = []
        pending: list[Request] = []
        owner: dict[str, tuple[RequestOutput, int]] = {}
        for i, (toks, text, p) in enumerate(zip(token_lists, texts, params, strict=True)):
            self._check_prompt(toks, p)
            ro = RequestOutput(str(next(self._ids)), text, toks, [CompletionOutput(j) for j in range(p.n)])
            results.append(ro)
            for j in range(p.n):
                sub = replace(p, n=1, seed=None if p.seed is None else p.seed + j)
                rid = f"{ro.request_id}-{j}" if p.n > 1 else ro.request_id
                pri = priority[i] if priority else 0
                ten = tenant[i] if tenant else "default"
                pending.append(Request(rid, list(toks), sub, priority=pri, tenant=ten))
                owner[rid] = (ro, j)
        self._drive(pending, owner, use_tqdm)
        return results

    def _check_prompt(self, toks: Sequence[int], p: SamplingParams) -> None:
        if not toks:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in toks if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary (size {self.engine.vocab_size})")
        if len(toks) + p.max_tokens > self.engine.max_model_len:
            raise ValueError(
                f"prompt: {len(toks)} prompt tokens + max_tokens {p.max_tokens} exceed max_model_len "
                f"{self.engine.max_model_len}"
            )

    def _drive(self, pending: list[Request], owner: dict, use_tqdm: bool) -> None:
        core = self.engine.core
        proc = OutputProcessor(self.tokenizer)
        bar = tqdm(total=len(pending), desc="generate", unit="req", disable=not use_tqdm or len(pending) < 2)
        queue = list(reversed(pending))
        try:
            while queue or core.has_unfinished_requests():
                self._admit(queue, proc)
                deltas, stopped = proc.process(core.step())
                if stopped:
                    core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
                for sd in deltas:
                    _apply(owner[sd.request_id], sd)
                    if sd.finished:
                        bar.update(1)
        except BaseException:
            core.abort_requests(list(owner))  # leave nothing behind in the engine
            raise
        finally:
            bar.close()

    def _admit(self, queue: list[Request], proc: OutputProcessor) -> None:
        """Feed requests while the engine's bounded queue accepts them; the rest wait their turn here."""
        while queue:
            req = queue[-1]
            try:
                self.engine.core.add_request(req)
            except AdmissionError as e:
                if e.kind == ErrorKind.QUEUE_FULL and self.engine.core.has_unfinished_requests():
                    return
                raise ValueError(e.message) from None
            proc.add_request(req.request_id, req.sampling_params, req.prompt_token_ids)
            queue.pop()


def _apply(target: tuple[RequestOutput, int], sd: StreamDelta) -> None:
    ro, j = target
    co = ro.outputs[j]
    co.text += sd.text
    co.token_ids.extend(sd.token_ids)
    if sd.logprobs is not None:
        co.logprobs = (co.logprobs or []) + sd.logprobs
    if sd.finished:
        co.finish_reason, co.stop_reason = sd.finish_reason, sd.stop_reason
        ro.num_cached_tokens = max(ro.num_cached_tokens, sd.num_cached_tokens)
        ro.metrics = ro.metrics or sd.metrics
        ro.finished = all(o.finished for o in ro.outputs)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"sampling_params: {len(sp)} given for {n} prompts")
    return sp
