"""The OpenAI-compatible API against a real server: the official `openai` client, and raw httpx for SSE framing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from cadence.server.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse

GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(body: str) -> list[str]:
    """Split an SSE body into data payloads, checking the exact framing on the way."""
    assert body.endswith("\n\n"), "every event ends with a blank line"
    events = body.split("\n\n")[:-1]
    out = []
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, repr(e)
        out.append(e[len("data: ") :])
    return out


def test_completion_matches_openai_shape_and_usage(oai, server):
    resp = oai.completions.create(
        model=server.engine.model_name,
        prompt="The capital of France is",
        max_tokens=7,
        extra_body={**NO_EOS, **GREEDY},
    )
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.text
    prompt_len = len(server.engine.tokenizer.encode("The capital of France is"))
    assert resp.usage.prompt_tokens == prompt_len and resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == prompt_len + 7
    CompletionResponse.model_validate(resp.model_dump())


def test_streaming_text_equals_non_streaming_text(oai):
    kw = {"prompt": "Once upon a time", "max_tokens": 12, "extra_body": {**NO_EOS, **GREEDY}}
    whole = oai.completions.create(model="cadence-tiny-random", **kw).choices[0].text
    chunks = list(oai.completions.create(model="cadence-tiny-random", stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_non_streaming_and_streaming(oai):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    resp = oai.chat.completions.create(
        model="cadence-tiny-random", messages=msgs, max_tokens=6, extra_body={**NO_EOS, **GREEDY}
    )
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6
    ChatCompletionResponse.model_validate(resp.model_dump())
    stream = oai.chat.completions.create(
        model="cadence-tiny-random",
        messages=msgs,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**NO_EOS, **GREEDY},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content


def test_raw_sse_framing(server):
    body = {
        "prompt": "Hello",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        **NO_EOS,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["usage"]["completion_tokens"] == 4 and payloads[-1]["choices"] == []
    assert all(p["object"] == "text_completion" and "usage" in p for p in payloads)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True, **NO_EOS}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=60) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        ChatCompletionChunk.model_validate_json(e)
        assert "usage" not in json.loads(e)  # only with stream_options.include_usage


@pytest.mark.parametrize(
    "prompt, num_prompts", [("one string", 1), (["a", "b c"], 2), ([15, 16, 17], 1), ([[15, 16], [17]], 2)]
)
def test_prompt_forms(client, prompt, num_prompts):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": 2, **NO_EOS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == list(range(2 * num_prompts))
    assert body["usage"]["completion_tokens"] == 4 * num_prompts


def test_n_with_seed_is_reproducible_and_choices_differ(client):
    body = {"prompt": "Tell me", "max_tokens": 8, "n": 3, "seed": 1234, "temperature": 1.0, **NO_EOS}
    a = client.post("/v1/completions", json=body).json()
    b = client.post("/v1/completions", json=body).json()
    texts_a = [c["text"] for c in sorted(a["choices"], key=lambda c: c["index"])]
    texts_b = [c["text"] for c in sorted(b["choices"], key=lambda c: c["index"])]
    assert texts_a == texts_b
    assert len(set(texts_a)) > 1  # seed + i per choice, not the same sample three times
    prompt_len = len(client.post("/tokenize", json={"prompt": "Tell me"}).json()["tokens"])
    assert a["usage"]["prompt_tokens"] == prompt_len  # counted once, not once per choice
    assert a["usage"]["completion_tokens"] == 24


def test_streaming_n_gives_every_index(client):
    body = {"prompt": "Hi", "max_tokens": 3, "n": 2, "stream": True, "seed": 3, **NO_EOS}
    events = sse_events(client.post("/v1/completions", json=body).text)
    finished = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert {c["index"] for c in finished if c["finish_reason"]} == {0, 1}


def test_stop_string_ends_the_text(client):
    base = {"prompt": "The weather today", "max_tokens": 20, **NO_EOS, **GREEDY}
    full = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 3
    stop = words[2]
    got = client.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
    assert got["text"] == full[: full.index(stop)]
    streamed = sse_events(client.post("/v1/completions", json={**base, "stop": stop, "stream": True}).text)
    text = "".join(json.loads(e)["choices"][0]["text"] for e in streamed[:-1])
    assert text == got["text"]


def test_max_tokens_min_tokens_and_penalties_are_accepted(client):
    body = {
        "prompt": "a",
        "max_tokens": 5,
        "min_tokens": 5,
        "top_k": 5,
        "top_p": 0.9,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
        "seed": 7,
        "logit_bias": {"42": -100.0},
        "user": "u1",
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_logprobs(client, server):
    r = client.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "logprobs": 3, **NO_EOS, **GREEDY}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(t) <= 3 and v <= 0 for t in lp["top_logprobs"] for v in t.values())
    assert lp["text_offset"] == sorted(lp["text_offset"])
    chat = {
        "messages": [{"role": "user", "content": "hey"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
        **NO_EOS,
        **GREEDY,
    }
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    # greedy: the sampled token is the most likely one
    assert all(c["logprob"] >= max(t["logprob"] for t in c["top_logprobs"]) - 1e-5 for c in content)
    assert all(bytes(c["bytes"]).decode() == c["token"] for c in content)


def test_scheduling_inputs_are_accepted(client, server):
    r = client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 2, "priority": 5, "deadline": 30.0},
        headers={"X-Tenant": "team-a"},
    )
    assert r.status_code == 200, r.text
    expired = client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 500, "deadline": 1e-6, **NO_EOS}
    )
    assert expired.status_code == 408 and expired.json()["error"]["code"] == "deadline_exceeded"


def test_models_health_ready_tokenize(oai, client, server):
    models = oai.models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]
    assert oai.models.retrieve(server.engine.model_name).id == server.engine.model_name
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json()["ready"] is True
    tok = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 1024
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    chat_tok = client.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "Hello world"}]}
    ).json()
    assert chat_tok["count"] > tok["count"]


def test_openapi_schema_documents_every_route(client, server):
    schema = client.get("/openapi.json").json()
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
        "/dashboard",
        "/dashboard/data",
        "/tokenize",
        "/detokenize",
    ):
        assert path in schema["paths"], path
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    name = body["$ref"].rsplit("/", 1)[1]
    props = schema["components"]["schemas"][name]["properties"]
    assert {"messages", "max_tokens", "priority", "deadline", "top_logprobs"} <= set(props)
    assert client.get("/docs").status_code == 200


def test_a_request_without_max_tokens_fits_a_kv_cache_smaller_than_the_context(server_factory):
    """max_tokens left out asks for the rest of the context, or of the whole KV cache where that is
    smaller (16 blocks x 16 = 256 tokens against a 1,024-token context): it runs to that length
    rather than being refused for a length it never asked for."""
    live = server_factory({"num_kv_blocks": 16, "block_size": 16})
    assert live.engine.max_request_tokens == 256 < live.engine.max_model_len
    r = httpx.post(live.url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
    too_many = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300})
    assert too_many.status_code == 400 and "KV cache" in too_many.json()["error"]["message"]


def test_completion_top_logprobs_include_the_sampled_token(client):
    """As OpenAI's legacy completions and vLLM: the sampled token is always among `top_logprobs`,
    so a step has N entries, or N + 1 when the sampled token is not among the top N."""
    body = {"prompt": "Hello", "max_tokens": 12, "logprobs": 1, "temperature": 1.0, "seed": 7, **NO_EOS}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    steps = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))
    assert len(steps) == 12
    for token, logprob, top in steps:
        assert top[token] == logprob and 1 <= len(top) <= 2
    # The tiny model's random weights make a sampled token outside the top one the usual case.
    assert any(len(top) == 2 for _, _, top in steps)
    zero = client.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert zero["top_logprobs"] == [{t: v} for t, v in zip(zero["tokens"], zero["token_logprobs"], strict=True)]


def test_chat_top_logprobs_list_the_sampled_token_first(client):
    """As vLLM's chat completions: `top_logprobs: N` gives N entries, the sampled token's first."""
    chat = {"messages": [{"role": "user", "content": "hey"}], "max_tokens": 10, "logprobs": True,
            "top_logprobs": 2, "temperature": 1.0, "seed": 7, **NO_EOS}
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 10
    for c in content:
        first, *others = c["top_logprobs"]
        assert len(others) == 1 and (first["token"], first["logprob"]) == (c["token"], c["logprob"])
    # Sampled tokens outside the top one were listed before the likeliest token.
    assert any(c["top_logprobs"][1]["logprob"] > c["logprob"] for c in content)
    zero = client.post("/v1/chat/completions", json={**chat, "top_logprobs": 0}).json()
    assert all(c["top_logprobs"] == [] for c in zero["choices"][0]["logprobs"]["content"])


def _stream_payloads(server, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + route, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_continuous_usage_stats_on_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries its choice's counts so far
    (its prompt's tokens, the tokens it has generated), and the last chunk the whole request's."""
    tokens = server.engine.tokenizer.encode
    options = {"include_usage": True, "continuous_usage_stats": True}
    prompts = ["Hello", "one two three four"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "stream_options": options, **NO_EOS}
    payloads = _stream_payloads(server, "/v1/completions", body)
    *chunks, last = payloads
    done: dict[int, int] = {}
    for p in chunks:
        (choice,) = p["choices"]
        i, usage = choice["index"], p["usage"]
        assert usage["prompt_tokens"] == len(tokens(prompts[i // 2]))
        assert usage["completion_tokens"] >= done.get(i, 0) + 1  # each chunk here carries a token
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        done[i] = usage["completion_tokens"]
    assert done == {0: 5, 1: 5, 2: 5, 3: 5}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 20
    assert last["usage"]["prompt_tokens"] == sum(len(tokens(p)) for p in prompts)

    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream_options": options, **NO_EOS}
    role, *chunks, last = _stream_payloads(server, "/v1/chat/completions", chat)
    prompt = last["usage"]["prompt_tokens"]
    assert role["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
    assert [c["usage"]["completion_tokens"] for c in chunks][-1] == 3
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)


def test_stream_options_usage_rules_are_vllms(server):
    """stream_options given at all asks for the usage chunk (vLLM's default include_usage: true);
    continuous_usage_stats does nothing without include_usage."""
    body = {"prompt": "Hello", "max_tokens": 2, **NO_EOS}
    *chunks, last = _stream_payloads(server, "/v1/completions", {**body, "stream_options": {}})
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    assert all(c["usage"] is None for c in chunks)
    off = {"include_usage": False, "continuous_usage_stats": True}
    payloads = _stream_payloads(server, "/v1/completions", {**body, "stream_options": off})
    assert all(p["choices"] and p.get("usage") is None for p in payloads)
