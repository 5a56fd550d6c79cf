"""The offline Python API, shaped as users of vLLM expect.

    from cadence import LLM, SamplingParams
    llm = LLM(max_num_seqs=32)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from cadence.clock import unix_offset
from cadence.config import EngineConfig
from cadence.engine.builder import Engine, build_engine
from cadence.engine.output_processor import OutputProcessor, StreamDelta, attach_final_metrics
from cadence.errors import AdmissionError, ErrorKind
from cadence.outputs import CompletionOutput, RequestOutput
from cadence.request import Request, RequestStatus, SamplingParams

Prompt = str | Sequence[int] | dict[str, Any]  # text, token ids, {"prompt": ...} or {"prompt_token_ids": ...}
Message = dict[str, Any]
# The roles the default chat templates know (the server accepts the same); a chat_template of
# one's own may use others.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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
        split_special_tokens: bool = False,
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in the prompts' order.

        A text prompt is tokenized as vLLM and Hugging Face tokenize it: special-token text such as
        `<|im_start|>` becomes the token it names (a prompt already rendered through the chat
        template runs as `chat` would run it); `split_special_tokens=True` reads it as ordinary
        characters instead. As in vLLM, a text prompt gets what the model's tokenizer adds around a
        text (a BOS for Llama models) unless `add_special_tokens=False`; token ids are taken as given.

        Every prompt and parameter is checked before any is queued: a ValueError or TypeError names
        the one at fault (`prompts[3]: ...`) and the engine is left as it was."""
        items = _as_prompt_list(prompts)
        token_lists = [self.tokenizer.encode(p, add_special_tokens, split_special_tokens=split_special_tokens)
                       if isinstance(p, str) else p for p in items]
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
        convs = _as_conversations(messages)
        token_lists = [self.encode_chat(conv, chat_template, f"messages[{c}]" if len(convs) > 1 else "messages")
                       for c, conv in enumerate(convs)]
        return self._run(token_lists, [None] * len(token_lists), sampling_params, use_tqdm, None, None)

    def encode_chat(self, conversation: Sequence[Message], chat_template: str | None = None,
                    name: str = "messages") -> list[int]:
        """One conversation through the chat template (as `chat` applies it): its token ids, or a
        ValueError naming the message at fault (`name[i].role: ...`)."""
        if chat_template is None:
            for i, m in enumerate(conversation):
                role = m.get("role") if isinstance(m, dict) else None
                if isinstance(role, str) and role and role not in CHAT_ROLES:
                    raise ValueError(f"{name}[{i}].role: must be one of {CHAT_ROLES} with the model's "
                                     f"chat template, got {role!r}")
        try:
            toks = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True,
                                                      chat_template=chat_template)
        except ValueError as e:
            # The tokenizer names the message (messages[1].content: ...); say which conversation.
            msg = str(e)
            raise ValueError(name + msg[len("messages"):] if msg.startswith("messages") else msg) from None
        return list(toks)

    def check_prompt(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                     name: str = "prompt") -> list[int]:
        """What `generate` checks of each prompt before queuing any (vocabulary, lengths, what the
        engine's admission would refuse): the ids as a list, or a ValueError/TypeError naming `name`.
        For callers that want to drop one bad request from a batch rather than fail the batch."""
        return self._check_prompt(name, prompt_token_ids, sampling_params)

    # -- the loop ----------------------------------------------------------------------------

    def _run(self, token_lists: list[list[int]], texts: list[str | None],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
             priority: Sequence[int] | None, tenant: Sequence[str] | None) -> list[RequestOutput]:
        n = len(token_lists)
        params = _as_params_list(sampling_params, n)
        priorities = _per_prompt(priority, n, "priority", int, "an integer")
        tenants = _per_prompt(tenant, n, "tenant", str, "a non-empty string")
        name = (lambda i: f"prompts[{i}]") if n > 1 else (lambda i: "prompt")
        token_lists = [self._check_prompt(name(i), toks, p) for i, (toks, p) in enumerate(zip(token_lists, params, strict=True))]
        self._compile_grammars(params)
        results: list[RequestOutput] = []
        pending: list[Request] = []
        owner: dict[str, tuple[RequestOutput, int]] = {}
        for i, (toks, text, p) in enumerate(zip(token_lists, texts, params, strict=True)):
            ro = RequestOutput(str(next(self._ids)), text, toks, [CompletionOutput(j) for j in range(p.n)])
            results.append(ro)
            for j in range(p.n):
                sub = replace(p, n=1, seed=None if p.seed is None else p.seed + j)
                rid = f"{ro.request_id}-{j}" if p.n > 1 else ro.request_id
                pri = priorities[i] if priorities else 0
                ten = tenants[i] if tenants else "default"
                pending.append(Request(rid, list(toks), sub, priority=pri, tenant=ten))
                owner[rid] = (ro, j)
        self._drive(pending, owner, use_tqdm)
        return results

    def _check_prompt(self, name: str, toks: Sequence[int], p: SamplingParams) -> list[int]:
        """The prompt as a list of ints, or an error naming it; also everything the engine's admission
        would refuse, so that no request is queued (and no work done) for a batch that must fail."""
        toks = list(toks)
        if not toks:
            raise ValueError(f"{name}: must contain at least one token")
        vocab = self.engine.vocab_size
        for t in toks:
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"{name}: token ids must be integers, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"{name}: token id {t} is outside the vocabulary (size {vocab})")
        for field_name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", [t for t, _ in p.logit_bias]),
                                ("allowed_token_ids", p.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{field_name}: token id {bad} is outside the vocabulary (size {vocab})")
        if len(toks) + p.max_tokens > self.engine.max_model_len:
            raise ValueError(
                f"{name}: {len(toks)} prompt tokens + max_tokens {p.max_tokens} exceed max_model_len "
                f"{self.engine.max_model_len}"
            )
        sched = self.engine.core.scheduler
        limit = sched.config.max_queued_tokens
        if limit is not None and len(toks) > limit:
            raise ValueError(f"{name}: {len(toks)} prompt tokens exceed max_queued_tokens ({limit}): "
                             "it could never be queued")
        try:  # the KV cache's capacity, and a prompt too long for one step without chunked prefill
            sched.admission.check_lengths(Request("check", toks, p))
        except AdmissionError as e:
            raise ValueError(f"{name}: {e.message}") from None
        return toks

    def _compile_grammars(self, params: Sequence[SamplingParams]) -> None:
        """Compile every constraint of the batch (at once, in the compiler's threads) before queuing
        any request: a bad one fails the batch with a ValueError naming the field, as a bad prompt does."""
        specs = list(dict.fromkeys(p.structured_outputs for p in params if p.structured_outputs is not None))
        structured = self.engine.core.structured
        if not specs or structured is None:
            return
        structured.validate_all(specs)

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
                    attach_final_metrics(deltas, core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED))
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
                # The batch's own requests: never dropped from the queue for another of them.
                self.engine.core.add_request(req, evict=False)
            except AdmissionError as e:
                busy = e.kind in (ErrorKind.QUEUE_FULL, ErrorKind.FAIR_SHARE)
                if busy and self.engine.core.has_unfinished_requests():
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
        if ro.metrics is None and sd.metrics is not None:
            ro.metrics = replace(sd.metrics, unix_offset=unix_offset())  # the engine runs on RealClock
        ro.finished = all(o.finished for o in ro.outputs)


_PROMPT_FORMS = "a string, a list of token ids, {'prompt': str} or {'prompt_token_ids': [int, ...]}"


def _is_ids(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and all(isinstance(t, int) for t in x)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """Prompts as text or token-id lists; TypeError naming the one that is neither."""
    items: list[Any]
    if isinstance(prompts, (str, dict)):
        items = [prompts]
    elif not isinstance(prompts, Iterable) or isinstance(prompts, bytes):
        raise TypeError(f"prompts: expected {_PROMPT_FORMS}, or a list of them; got {type(prompts).__name__}")
    else:
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            items = [items]  # one prompt given as token ids
    out: list[str | list[int]] = []
    for i, p in enumerate(items):
        if isinstance(p, dict):
            if set(p) == {"prompt"} and isinstance(p["prompt"], str):
                p = p["prompt"]
            elif set(p) == {"prompt_token_ids"} and _is_ids(p["prompt_token_ids"]):
                p = p["prompt_token_ids"]
            else:
                raise TypeError(f"prompts[{i}]: expected {_PROMPT_FORMS}; got a dict with keys {sorted(p)}")
        if isinstance(p, str):
            out.append(p)
        elif _is_ids(p):
            out.append(list(p))
        else:
            raise TypeError(f"prompts[{i}]: expected {_PROMPT_FORMS}; got {p!r:.80}")
    return out


def _as_conversations(messages: Any) -> list[list[Message]]:
    """One conversation (a list of message dicts) or a list of them; TypeError otherwise."""
    form = "a list of {'role': ..., 'content': ...} dicts (one conversation) or a list of such lists"
    if isinstance(messages, dict):
        raise TypeError(f"messages: expected {form}; got a single dict (wrap it in a list)")
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TypeError(f"messages: expected {form}; got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: must not be empty")
    if isinstance(messages[0], dict):
        return [list(messages)]
    convs = []
    for c, conv in enumerate(messages):
        if not isinstance(conv, Sequence) or isinstance(conv, (str, bytes)):
            raise TypeError(f"messages[{c}]: expected {form}; got {type(conv).__name__}")
        convs.append(list(conv))
    return convs


def _per_prompt(values: Sequence[Any] | None, n: int, name: str, kind: type, words: str) -> list[Any] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a list with one value per prompt, got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} given for {n} prompts")
    for i, v in enumerate(values):
        if not isinstance(v, kind) or isinstance(v, bool) or v == "":
            raise TypeError(f"{name}[{i}]: must be {words}, got {v!r}")
    return list(values)


def _as_params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if isinstance(sp, (str, bytes, dict)) or not isinstance(sp, Iterable):
        raise TypeError(f"sampling_params: expected SamplingParams or a list of them, got {type(sp).__name__}")
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"sampling_params: {len(sp)} given for {n} prompts")
    for i, p in enumerate(sp):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}]: expected SamplingParams, got {type(p).__name__}")
    return sp
