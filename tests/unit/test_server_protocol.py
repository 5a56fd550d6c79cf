"""Request validation and the error table, without an engine: pydantic models and the mapping to HTTP."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cadence.errors import AdmissionError, CadenceError, ErrorKind
from cadence.server.errors import ERROR_TABLE, APIError, HTTPKind, describe_validation, from_exception
from cadence.server.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    TokenizeRequest,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "hello", **kw}))


def refused(model, body: dict | bytes) -> tuple[str, str | None]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(raw)
    return describe_validation(info.value.errors())


def test_prompt_forms_become_a_list_of_prompts():
    assert completion().prompts() == ["hello"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_defaults_follow_openai():
    req = completion()
    assert req.max_tokens == 16 and req.n == 1 and req.stream is False and req.temperature is None
    chat = ChatCompletionRequest.model_validate_json(json.dumps(CHAT))
    assert chat.requested_max_tokens() is None and chat.num_logprobs() is None


def test_unknown_fields_are_ignored_known_ones_are_typed():
    req = completion(frobnicate={"x": 1}, temperature=1)  # an int is a fine float
    assert req.temperature == 1.0 and not hasattr(req, "frobnicate")
    _, param = refused(CompletionRequest, {"prompt": "x", "max_tokens": "5"})
    assert param == "max_tokens"
    _, param = refused(CompletionRequest, {"prompt": "x", "max_tokens": True})
    assert param == "max_tokens"
    _, param = refused(CompletionRequest, {"prompt": "x", "stream": "yes"})
    assert param == "stream"


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 10**12),
        ("n", 0),
        ("n", 17),
        ("temperature", -0.5),
        ("temperature", 1e308 * 10),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -9.0),
        ("repetition_penalty", 0.0),
        ("seed", -1),
        ("logprobs", 21),
        ("top_k", -5),
        ("deadline", 0),
        ("deadline", -3.0),
        ("priority", 2**40),
        ("stop", [""]),
        ("stop", ["x" * 257]),
        ("stop", ["s"] * 17),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"5": 500.0}),
        ("user", "u" * 300),
        ("min_tokens", -1),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    message, param = refused(CompletionRequest, {"prompt": "x", field: value})
    assert param is not None and param.split(".")[0] == field, (message, param)
    assert message


def test_nan_and_infinity_are_refused():
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        message, param = refused(CompletionRequest, b'{"prompt": "x", "temperature": ' + literal + b"}")
        assert param == "temperature", message


def test_deep_nesting_and_bad_json_are_invalid_json():
    deep = b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    message, param = refused(CompletionRequest, deep)
    assert message.startswith("invalid JSON body") and param is None
    message, _ = refused(CompletionRequest, b'{"prompt": ')
    assert message.startswith("invalid JSON body")


def test_a_lone_surrogate_escape_is_refused_saying_what_is_wrong():
    # (the parser's own words: "unexpected end of hex escape", "lone leading surrogate" for a trailing one)
    for body in (b'{"prompt": "\\ud800 hi"}', b'{"prompt": "x\\udfff"}', b'{"prompt": "\\ud800\\u0041"}'):
        message, param = refused(CompletionRequest, body)
        assert message.startswith("invalid JSON body") and param is None, message
        assert "surrogate pair and must be followed by its other half" in message, message
    assert CompletionRequest.model_validate_json(b'{"prompt": "\\ud83d\\ude00"}').prompts() == ["\U0001f600"]


def test_missing_fields():
    _, param = refused(CompletionRequest, {"max_tokens": 3})
    assert param == "prompt"
    _, param = refused(ChatCompletionRequest, {"model": "m"})
    assert param == "messages"
    _, param = refused(ChatCompletionRequest, {"messages": []})
    assert param == "messages"
    _, param = refused(ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]})
    assert param == "messages.0.role"


def test_prompt_shapes_are_checked():
    for bad in ("", [], [-1], [[]], [1, "a"], {"a": 1}, [[1], ["a"]]):
        _, param = refused(CompletionRequest, {"prompt": bad})
        assert param and param.startswith("prompt"), bad
    _, param = refused(CompletionRequest, {"prompt": ["x"] * 65})
    assert param == "prompt"


@pytest.mark.parametrize(
    "body, message, param",
    [
        # One error per union member: the one that says what is wrong with the form used is reported,
        # not "Input should be a valid string" for a list, nor "(and 3 more errors)" for one mistake.
        ({"prompt": [-1]}, "prompt.0: Input should be greater than or equal to 0", "prompt.0"),
        ({"prompt": [[1], [-2]]}, "prompt.1.0: Input should be greater than or equal to 0", "prompt.1.0"),
        ({"prompt": ["a", ""]}, "prompt.1: String should have at least 1 character", "prompt.1"),
        ({"prompt": ["a"] * 65}, "prompt: List should have at most 64 items", "prompt"),
        ({"prompt": "x", "stop": ["x" * 257]}, "stop.0: String should have at most 256 characters", "stop.0"),
        ({"prompt": [-1], "max_tokens": 0}, "prompt.0: Input should be greater than or equal to 0 (and 1 more error)", "prompt.0"),
        # No member fits at all: the message lists the accepted forms.
        ({"prompt": None}, "prompt: must be a non-empty string, a list of strings, a list of token ids", "prompt"),
        ({"prompt": [1.5]}, "prompt: must be a non-empty string", "prompt"),
        ({"prompt": "x", "stop": 5}, "stop: must be a string or a list of strings", "stop"),
    ],
)
def test_union_errors_say_what_is_wrong_with_the_form_used(body, message, param):
    got, got_param = refused(CompletionRequest, body)
    assert got.startswith(message) and "more errors" not in got and got_param == param, got


def test_chat_content_errors_name_the_part():
    def chat(content):
        return {"messages": [{"role": "user", "content": content}]}

    message, param = refused(ChatCompletionRequest, chat([{"type": "image_url", "image_url": {"url": "x"}}]))
    assert param == "messages.0.content.0.type" and "'text'" in message, message
    message, param = refused(ChatCompletionRequest, chat(5))
    assert param == "messages.0.content" and "a list of" in message, message


def test_message_content_is_required_but_for_the_assistant():
    for role in ("user", "system", "developer", "tool"):
        for msg in ({"role": role}, {"role": role, "content": None}):
            message, param = refused(ChatCompletionRequest, {"messages": [msg]})
            assert param == "messages.0.content" and "required" in message, (msg, message)
    ok = {"messages": [{"role": "user", "content": ""}, {"role": "assistant"}], "add_generation_prompt": False}
    assert ChatCompletionRequest.model_validate_json(json.dumps(ok)).message_dicts()[1]["content"] == ""
    _, param = refused(TokenizeRequest, {"messages": [{"role": "user"}]})
    assert param == "messages.0.content"


def test_tool_calls_in_history_are_taken_on_assistant_messages_only():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    body = {"messages": [*CHAT["messages"], {"role": "assistant", "content": None, "tool_calls": [call]}, answer]}
    req = ChatCompletionRequest.model_validate_json(json.dumps(body))
    assert req.messages[1].tool_calls[0].function.name == "f" and req.messages[2].tool_call_id == "c1"
    message, param = refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "tool_calls": [call]}]})
    assert param == "messages.0.tool_calls" and "only an assistant message" in message
    message, param = refused(ChatCompletionRequest, {"messages": [{"role": "tool", "content": "42"}]})
    assert param == "messages.0.tool_call_id" and "required" in message
    _, param = refused(ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]})
    assert param == "messages.0.tool_calls.0.function"


def test_choices_are_capped_across_prompts():
    message, _ = refused(CompletionRequest, {"prompt": ["x"] * 16, "n": MAX_CHOICES // 16 + 1})
    assert "prompts x n" in message


def test_chat_consistency_rules():
    message, param = refused(ChatCompletionRequest, {**CHAT, "top_logprobs": 3})
    assert "logprobs" in message
    message, _ = refused(ChatCompletionRequest, {**CHAT, "tools": [{"type": "function"}]})
    assert "tools" in message
    req = ChatCompletionRequest.model_validate_json(json.dumps({**CHAT, "logprobs": True, "top_logprobs": 2}))
    assert req.num_logprobs() == 2
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]
    }
    assert ChatCompletionRequest.model_validate_json(json.dumps(parts)).message_dicts()[0]["content"] == "ab"
    _, param = refused(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    assert param and param.startswith("messages.0.content")


def test_tokenize_needs_exactly_one_input():
    refused(TokenizeRequest, {})
    refused(TokenizeRequest, {"prompt": "a", **CHAT})
    assert TokenizeRequest.model_validate_json(b'{"prompt": "a"}').prompt == "a"
    _, param = refused(DetokenizeRequest, {"tokens": [1, -2]})
    assert param == "tokens.1"


def test_error_table_covers_every_kind_with_openai_types():
    for kind in [*ErrorKind, *HTTPKind]:
        spec = ERROR_TABLE[kind]
        assert 400 <= spec.status < 600 and spec.type and spec.code
    assert ERROR_TABLE[ErrorKind.QUEUE_FULL].status == 429
    assert ERROR_TABLE[HTTPKind.UNAUTHORIZED].type == "authentication_error"
    assert ERROR_TABLE[HTTPKind.BODY_TOO_LARGE].status == 413
    assert ERROR_TABLE[HTTPKind.MODEL_NOT_FOUND].status == 404


def _body(resp) -> dict:
    return json.loads(resp.body)


def test_exceptions_become_openai_error_bodies():
    resp = from_exception(AdmissionError(ErrorKind.QUEUE_FULL, "queue is full", retry_after=2.2))
    assert resp.status_code == 429 and resp.headers["retry-after"] == "3"
    assert _body(resp) == {
        "error": {"message": "queue is full", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    }
    resp = from_exception(APIError(HTTPKind.MODEL_NOT_FOUND, "no such model", param="model"))
    assert resp.status_code == 404 and _body(resp)["error"]["param"] == "model"
    resp = from_exception(ValueError("top_p: must be in (0, 1]"))
    assert resp.status_code == 400 and _body(resp)["error"]["param"] == "top_p"
    resp = from_exception(CadenceError(ErrorKind.INTERNAL, "step failed"))
    assert resp.status_code == 500 and _body(resp)["error"]["type"] == "server_error"
    resp = from_exception(RuntimeError("boom"))
    assert resp.status_code == 500 and "boom" not in _body(resp)["error"]["message"]  # no internals leak


def test_response_model_accepts_openai_shape():
    body = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    assert CompletionResponse.model_validate(body).choices[0].text == "x"
