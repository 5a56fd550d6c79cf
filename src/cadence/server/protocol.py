"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests are strict: a known field of the wrong type is refused (no "1" for 1, no `true` for 1),
numbers must be finite, every size has a cap; unknown fields are ignored, as OpenAI does, but a
field that vLLM defines and cadence does not implement is refused when it asks for anything but its
default (a vLLM client should not get a silently different answer: `UNSUPPORTED_VLLM_FIELDS`). Bounds
mirror `SamplingParams` so that what passes here also passes there; checks that need the model
(vocabulary, context length) happen in inputs.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cadence.request import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MIN_REPETITION_PENALTY,
)

# Caps beyond SamplingParams': they bound the work and memory one request can ask for.
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_CHOICES = 128  # prompts x n
MAX_TOKENS_CAP = 1 << 20  # an "absurd" max_tokens is refused before the context check
MAX_MESSAGES = 1024
MAX_CHAT_TEMPLATE_CHARS = 65536
MAX_USER_CHARS = 256
MAX_DEADLINE_S = 86400.0
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = (1 << 31) - 1  # larger ids cannot be in any vocabulary; the vocab check comes later
# Structured output and tools (docs/structured_output.md): the grammar library bounds its own work,
# these bound what one request can hand it.
MAX_TOOLS = 128
MAX_TOOL_CALLS_IN_MESSAGE = 128
MAX_GUIDED_CHOICES = 256
MAX_GUIDED_CHOICE_CHARS = 1024
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHARS = 65536
MAX_DESCRIPTION_CHARS = 8192
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"

# vLLM's request fields that cadence does not implement, each with the values that ask for nothing
# (its default, and what a client that sends every field sends). Any other value is a 400 naming it.
_NOTHING: tuple[Any, ...] = (None,)
UNSUPPORTED_VLLM_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": _NOTHING,
    "truncate_prompt_tokens": _NOTHING,
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "cache_salt": _NOTHING,
    "kv_transfer_params": _NOTHING,
    "vllm_xargs": (None, {}),
    "prompt_embeds": _NOTHING,
    "mm_processor_kwargs": (None, {}),
    "chat_template_kwargs": (None, {}),
    "documents": _NOTHING,
    "continue_final_message": (None, False),
}

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LEN)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def refuse_unsupported_vllm_fields(data: Any) -> Any:
    """ValueError naming the first vLLM field asked for that cadence does not implement."""
    if isinstance(data, dict):
        for name, nothing in UNSUPPORTED_VLLM_FIELDS.items():
            if name in data and not any(type(data[name]) is type(v) and data[name] == v for v in nothing):
                raise ValueError(f"{name}: not supported by this server (a vLLM option cadence does not "
                                 f"implement); leave it out")
    return data


class StreamOptions(StrictModel):
    """As vLLM: given at all, stream_options asks for the usage chunk unless include_usage is false
    (or null); continuous_usage_stats adds usage to every chunk, and only with include_usage."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False
    # cadence's own: the stream starts with an SSE comment (which OpenAI clients skip) giving the
    # request's place in the queue and its predicted time to first token.
    include_queue_status: bool | None = False


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`, OpenAI's shape. `strict` is accepted either way: the schema is
    always enforced by the grammar."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)

    @field_validator("schema_")
    @classmethod
    def _schema_given(cls, v: dict[str, Any] | bool | None) -> dict[str, Any] | bool:
        if v is None:
            raise ValueError("schema: required (the JSON schema the output must follow)")
        return v


class ResponseFormat(StrictModel):
    """`response_format`: text (no constraint), any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(cls, v: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        kind = info.data.get("type")
        if v is None and kind == "json_schema":
            raise ValueError("required when type is 'json_schema'")
        if v is not None and kind in ("text", "json_object"):
            # Taken with another type the schema would be ignored, and the output not follow it.
            raise ValueError(f"given with type {kind!r}, which takes no schema (use type 'json_schema')")
        return v


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object.
    Its other options are taken where cadence implements them and refused otherwise (in structured.py);
    an unknown key is refused rather than ignored."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_REGEX_CHARS)
    choice: list[Annotated[str, Field(min_length=1, max_length=MAX_GUIDED_CHOICE_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_GUIDED_CHOICES
    )
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class StructuredFields(StrictModel):
    """What constrains the output, in OpenAI's spelling (`response_format`) and vLLM's (`guided_*`,
    `structured_outputs`); at most one per request. Turned into a StructuredOutputsParams by
    structured.py, which also checks what needs more than a type."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = Field(default=None, min_length=1, max_length=MAX_REGEX_CHARS)
    guided_choice: list[Annotated[str, Field(min_length=1, max_length=MAX_GUIDED_CHOICE_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_GUIDED_CHOICES
    )
    guided_grammar: str | None = Field(default=None, min_length=1)
    guided_decoding_backend: str | None = Field(default=None, max_length=256)
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputsField | None = None


class SamplingFields(StructuredFields):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(default=None, max_length=256)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    stop: StopStr | list[StopStr] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_CAP)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True  # false: this request never speculates (where the server speculates)
    # Scheduling inputs (cadence extensions): a lower priority value is served first under the priority
    # policy; deadline is seconds from arrival after which the request is dropped if not done.
    priority: int = Field(default=0, ge=-(1 << 31), lt=1 << 31)
    deadline: float | None = Field(default=None, gt=0.0, le=MAX_DEADLINE_S)

    _vllm_fields = model_validator(mode="before")(refuse_unsupported_vllm_fields)

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI and vLLM: options for a stream that is not asked for are a client's mistake.
        if v is not None and info.data.get("stream") is False:
            raise ValueError("only allowed when stream is true")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key in v:
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise ValueError(
                    f"keys must be token ids (non-negative integers as strings), got {key[:32]!r}"
                )
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def include_queue_status(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_queue_status)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


CHAT_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)
        ]
    )
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_CAP)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    # False (as vLLM reads a prompt): special-token text such as "<|im_start|>" is the token it
    # names. True (transformers' name): ordinary characters.
    split_special_tokens: bool = False
    # As vLLM: a raw prompt gets what the model's tokenizer adds (a BOS for Llama models).
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data: Any) -> Any:
        # Tools are chat's: on this route they would be ignored, and the output neither a call nor constrained.
        if isinstance(data, dict):
            for name in CHAT_TOOL_FIELDS:
                if data.get(name) is not None:
                    raise ValueError(f"{name}: tools are a chat field; send them to /v1/chat/completions")
        return data

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"n: prompts x n must be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a flat list of ints is one prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)  # type: ignore[arg-type]


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    """A call an assistant made earlier in the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted either way: forced calls always follow the schema


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required (as OpenAI and llama.cpp require it) but for an assistant turn; validated when
    # absent too, so that a missing content is refused rather than read as "".
    content: str | Annotated[list[TextPart], Field(max_length=256)] | None = Field(
        default=None, validate_default=True
    )
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_TOOL_CALLS_IN_MESSAGE)
    tool_call_id: str | None = Field(default=None, max_length=256, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_required(cls, v: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        role = info.data.get("role")  # absent when the role itself was refused
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"required for a {role!r} message (a string or a list of text parts)")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_assistant(cls, v: list[ToolCallIn] | None, info: ValidationInfo) -> list[ToolCallIn] | None:
        role = info.data.get("role")
        if v and role is not None and role != "assistant":
            raise ValueError("only an assistant message carries tool calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("role") == "tool":
            raise ValueError("required for a 'tool' message (the id of the call it answers)")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_input(self) -> dict[str, Any]:
        """The message as the chat template sees it: role and content, and its name when it has one
        (as vLLM and transformers pass it; templates that write names see it). Tool calls and the
        id a tool message answers are added by tools.py, which decides how the template gets them."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    chat_template: str | None = Field(default=None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # As vLLM: off, the chat template writes the BOS itself; on, the tokenizer's own are added too.
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]


class TokenizeRequest(StrictModel):
    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)  # with messages: as a chat offers them
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    split_special_tokens: bool = False  # for `prompt`, as on /v1/completions
    # As vLLM: by default true for a `prompt` (as /v1/completions), false for `messages` (as chat).
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be given")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = Field(default=None, max_length=256)
    tokens: list[TokenId] = Field(max_length=1 << 20)


# -- responses (documentation in the OpenAPI schema, and a shape the tests check bodies against) --


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class FunctionCallDelta(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(ResponseModel):
    """A call's first delta has its id, type and function name; the next ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cadence"
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorBody
