"""From a validated request body to engine inputs: token ids, SamplingParams, tenant, cache salt.

These checks need the model (its vocabulary, context length, chat template), so they run here
rather than in protocol.py; each failure is a 400 naming the parameter.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from cadence.config import ServerConfig
from cadence.errors import CadenceError, ErrorKind
from cadence.model.template_limits import ChatTemplateLimitError
from cadence.model.template_process import WORKERS
from cadence.request import RequestPolicy, SamplingParams, StructuredOutputsParams
from cadence.server.engine_client import EngineClient
from cadence.server.errors import APIError, HTTPKind, param_of
from cadence.server.protocol import ChatCompletionRequest, ChatMessage, SamplingFields
from cadence.server.structured import Constraint, only_one, request_constraints
from cadence.server.tools import NO_TOOLS, ToolPlan, plan_tools, template_mentions_tools, template_messages
from cadence.wording import counted

TENANT_HEADER = "x-tenant"
KEY_TENANT_SCOPE = "cadence.key_tenant"  # set by the API-key middleware when the key maps to a tenant
_TENANT_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,64}$")
_ENCODE_IN_THREAD_CHARS = 8192  # longer prompts are tokenized off the event loop

log = logging.getLogger("cadence.server")


@dataclass(frozen=True)
class Job:
    """One validated request, ready for the engine."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    policy: RequestPolicy
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # usage on every chunk (stream_options.continuous_usage_stats)
    queue_status: bool = False  # a first SSE comment with its queue position (stream_options.include_queue_status)
    constraint_field: str | None = None  # the request field its structured-output constraint came from

    def in_request_terms(self, error: CadenceError) -> CadenceError:
        """An engine error that is the request's own fault (its constraint past the grammar
        library's limits) names the field the constraint came from, as a refusal does."""
        if error.kind is not ErrorKind.INVALID_REQUEST or error.param or not self.constraint_field:
            return error
        return CadenceError(error.kind, f"{self.constraint_field}: {error.message}", param=self.constraint_field)


class InputBuilder:
    """Checks a request against the served model and builds the `Job` the engine runs."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        # Requests' own chat templates wait for a render process here, not in the loop's default
        # thread pool, where they would hold the threads every other chat renders in.
        self._template_threads = ThreadPoolExecutor(WORKERS, thread_name_prefix="cadence-request-template")
        cache_cfg = getattr(getattr(engine.engine, "config", None), "cache", None)
        self.isolate_tenants = bool(config.api_key_tenants) or bool(
            getattr(cache_cfg, "tenant_isolation", False)
        )

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model answers to: its served name first, then --served-model-name's others."""
        return (self.engine.model_name, *(a for a in self.config.model_aliases if a != self.engine.model_name))

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            served = " or ".join(repr(n) for n in self.model_names)
            raise APIError(
                HTTPKind.MODEL_NOT_FOUND,
                f"the model {name!r} does not exist; this server serves {served}",
                param="model",
            )

    async def prompt_ids(
        self,
        prompt: str | list[int],
        param: str,
        *,
        allow_empty: bool = False,
        split_special_tokens: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A raw prompt's ids: special-token text is the token it names unless `split_special_tokens`;
        `add_special_tokens` adds what the model's tokenizer adds (a BOS for Llama models)."""
        if not isinstance(prompt, str):
            return self.check_ids(prompt, param)
        try:
            self.engine.tokenizer.check_fits(prompt, self.engine.max_model_len, param)
        except ValueError as e:
            raise APIError(ErrorKind.INVALID_REQUEST, str(e), param=param) from None
        encode = functools.partial(self.engine.tokenizer.encode, add_special_tokens=add_special_tokens,
                                   split_special_tokens=split_special_tokens)
        ids = (
            await asyncio.to_thread(encode, prompt)
            if len(prompt) > _ENCODE_IN_THREAD_CHARS
            else encode(prompt)
        )
        if not ids and not allow_empty:
            raise APIError(
                ErrorKind.INVALID_REQUEST, f"{param}: the prompt encodes to no tokens", param=param
            )
        return list(ids)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise APIError(
                ErrorKind.INVALID_REQUEST,
                f"{param}: token id {bad} is outside the vocabulary (size {vocab})",
                param=param,
            )
        return list(ids)

    async def chat_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template: str | None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat's token ids. Rendering and tokenizing run in a worker thread: a template's work is
        bounded by the model's chat-template limits, not by the event loop's patience."""
        ids = await self._render_chat(messages, add_generation_prompt, template, tools)
        return self.engine.tokenizer.add_special_tokens(ids) if add_special_tokens else ids

    async def _render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, template: str | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if template is not None and not self.config.allow_request_chat_template:
            raise APIError(
                ErrorKind.INVALID_REQUEST,
                "chat_template: this server does not accept a chat template in the request "
                "(its operator can allow it with --allow-request-chat-template)",
                param="chat_template",
            )
        render = functools.partial(self.engine.tokenizer.apply_chat_template, messages,
                                   add_generation_prompt=add_generation_prompt, chat_template=template,
                                   max_tokens=self.engine.max_model_len, tools=tools)
        try:
            if template is None:
                return list(await asyncio.to_thread(render))
            return list(await asyncio.get_running_loop().run_in_executor(self._template_threads, render))
        except ChatTemplateLimitError as e:
            raise self._limit_error(e, template) from None
        except ValueError as e:
            # The tokenizer speaks "field: why" (messages[0].content: ..., chat_template: ...); what
            # names no field came from the template: the request's own, or the model's.
            message = str(e)
            param = (param_of(message) or ("chat_template" if template is not None else "messages")).split("[")[0]
            raise APIError(ErrorKind.INVALID_REQUEST, message, param=param) from None
        except Exception as e:  # a template (from the request) that does not render
            if template is None:
                raise
            raise APIError(
                ErrorKind.INVALID_REQUEST, f"chat_template: {type(e).__name__}: {e}", param="chat_template"
            ) from None

    @staticmethod
    def _limit_error(e: ChatTemplateLimitError, template: str | None) -> Exception:
        """A request's own template over a limit is the request's fault (400); the model's template
        over a limit is the server's (500, and logged for its operator)."""
        if template is not None:
            return APIError(
                ErrorKind.INVALID_REQUEST,
                f"chat_template: the template {e.what}, over this server's limit{e.hint()}",
                param="chat_template",
            )
        log.error("the model's chat template %s on a request%s", e.what, e.hint())
        return CadenceError(
            ErrorKind.INTERNAL,
            f"the model's chat template {e.what} on this conversation, over this server's limit{e.hint()}",
        )

    def tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        with _refusing():
            return plan_tools(body)

    def constraint(self, body: SamplingFields, plan: ToolPlan | None = None) -> Constraint | None:
        """The one constraint on the output the request asks for (None: none); 400 for two."""
        with _refusing():
            found = request_constraints(body)
            forced = plan.constraint() if plan is not None else None
            constraint = only_one(found + ([forced] if forced is not None else []))
            if constraint is not None and body.allowed_token_ids is not None:
                # Two hard masks whose intersection may be empty: no token could be sampled.
                raise ValueError(f"allowed_token_ids: cannot be combined with {constraint.field} (both restrict "
                                 f"the tokens that may be sampled; give one of them)")
            return constraint

    async def check_constraint(self, constraint: Constraint | None, params: SamplingParams) -> None:
        """Have the engine compile the constraint now (cached for when the request is admitted), so
        that one its grammar library refuses is a 400 naming the request's field (a fleet's ingress
        compiles it too). An engine client without `validate_structured` leaves the check to the
        engine the request reaches."""
        validate = getattr(self.engine, "validate_structured", None)
        if constraint is None or validate is None:
            return
        try:
            await validate(params)
        except ValueError as e:
            with _refusing():
                raise constraint.compile_error(e) from None

    def chat_messages(self, messages: list[ChatMessage], template: str | None,
                      plan: ToolPlan = NO_TOOLS) -> tuple[list[dict[str, Any]], Any]:
        """(messages, tools) for the chat template: natively when the template mentions tools, else
        through the fallback of tools.py (which puts the tools in the messages)."""
        source = template if template is not None else self.engine.tokenizer.chat_template
        native = template_mentions_tools(source)
        with _refusing():
            rendered = template_messages(messages, plan, native)
        return rendered, (plan.template_tools() if native else None)

    def job(
        self,
        prefix: str,
        body: SamplingFields,
        raw: Request,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        structured: StructuredOutputsParams | None = None,
    ) -> Job:
        params = self._params(body, prompts, max_tokens, logprobs, prompt_param, structured)
        tenant, salt = self._tenant(raw, body.user)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        if self.config.log_requests:
            log.info("request %s: tenant %s, %d prompt(s) of %s tokens, priority %d, %s", request_id, tenant,
                     len(prompts), ",".join(str(len(p)) for p in prompts), body.priority, params)
        return Job(
            request_id,
            prompts,
            params,
            RequestPolicy(body.priority, tenant, body.deadline, salt),
            body.stream,
            body.include_usage,
            body.continuous_usage,
            body.include_queue_status,
        )

    def _params(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        longest, limit = max(len(p) for p in prompts), self.engine.max_model_len
        if longest >= limit:
            raise APIError(
                ErrorKind.INVALID_REQUEST,
                f"{prompt_param}: the prompt has {counted(longest, 'token')} but this model's context is "
                f"{counted(limit, 'token')} (max_model_len), leaving no room to generate",
                param=prompt_param,
            )
        if max_tokens is None:
            # The rest of the context, or of the KV cache where that is smaller (a small
            # --kv-cache-memory would otherwise refuse every request that names no max_tokens).
            room = self.engine.max_request_tokens - longest
            max_tokens = room if room >= 1 else limit - longest  # (no room: admission says why)
        elif longest + max_tokens > limit:
            raise APIError(
                ErrorKind.INVALID_REQUEST,
                f"max_tokens: the prompt has {counted(longest, 'token')} and max_tokens is {max_tokens}, "
                f"{longest + max_tokens} in all, over this model's context of {counted(limit, 'token')}",
                param="max_tokens",
            )
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        self.check_ids(list(bias), "logit_bias")
        self.check_ids(body.stop_token_ids or [], "stop_token_ids")
        self.check_ids(body.allowed_token_ids or [], "allowed_token_ids")
        options: dict[str, Any] = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "seed": body.seed,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
        }
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                n=body.n,
                stop=tuple(body.stop_list()),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                logit_bias=tuple(bias.items()),
                allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                speculative=body.speculative,
                structured_outputs=structured,
                **{k: v for k, v in options.items() if v is not None},
            )
        except ValueError as e:
            field_name = str(e).split(":", 1)[0]
            raise APIError(ErrorKind.INVALID_REQUEST, str(e), param=field_name) from None

    def _tenant(self, raw: Request, user: str | None) -> tuple[str, str | None]:
        """(tenant, prefix-cache salt). A key's tenant wins; else X-Tenant; else `user`; else "default"."""
        key_tenant = raw.scope.get(KEY_TENANT_SCOPE)
        if key_tenant:
            tenant, verified = key_tenant, True
        else:
            header = raw.headers.get(TENANT_HEADER)
            if header is not None and not _TENANT_RE.match(header):
                raise APIError(
                    ErrorKind.INVALID_REQUEST,
                    "X-Tenant: must be 1 to 64 characters from A-Z a-z 0-9 . _ : @ -",
                    param="X-Tenant",
                )
            tenant, verified = header or user or "default", False
        if not self.isolate_tenants:
            return tenant, None
        # A tenant only claimed (header or user) never shares cached blocks with a key-verified one.
        return tenant, ("key:" if verified else "claimed:") + tenant


@contextlib.contextmanager
def _refusing() -> Iterator[None]:
    """A ValueError ("field: why") as the 400 naming that field."""
    try:
        yield
    except ValueError as e:
        message = str(e)
        raise APIError(ErrorKind.INVALID_REQUEST, message, param=param_of(message)) from None
