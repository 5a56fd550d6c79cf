"""Extreme floats in every sampling field, offline (SamplingParams, LLM) and served (/v1/completions):
each value is refused naming its field (ValueError, or a 400 whose `param` is the field), or the
request generates valid tokens (ids inside the vocabulary, finite logprobs). A temperature below
SAMPLING_EPS (1e-300, subnormals, -0.0) samples greedily; it used to divide the logits by a float32
zero and emit token 0 or the last token of the vocabulary. `allowed_token_ids` outside the
vocabulary, negative or empty are refused like `logit_bias` keys, and the tokens sampled are the
allowed ones."""

from __future__ import annotations

import math

import pytest
from hostile import FLOAT_FIELDS, check_error, encode, extreme_floats, fuzz_settings, json_numbers_finite
from hypothesis import given
from hypothesis import strategies as st

from cadence import SamplingParams
from cadence.request import SAMPLING_EPS

PROMPT = "The tide came in over"
N_OUT = 3
BIAS_TOKEN = 100


def params_for(field: str, value: float, **extra) -> dict:
    """The sampling options that put `value` in `field` (logit_bias: one token's bias)."""
    opts = {"logit_bias": {BIAS_TOKEN: value}} if field == "logit_bias" else {field: value}
    return {"max_tokens": N_OUT, "ignore_eos": True, **opts, **extra}


def greedy_tokens(llm) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


def assert_valid(llm, params: SamplingParams) -> list[int]:
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    vocab = llm.engine.vocab_size
    assert len(out.token_ids) == N_OUT and out.finish_reason == "length"
    assert all(0 <= t < vocab for t in out.token_ids), out.token_ids
    if params.allowed_token_ids is not None:
        assert set(out.token_ids) <= set(params.allowed_token_ids)
    if out.logprobs is not None:
        assert all(math.isfinite(lp.logprob) for lp in out.logprobs)
    return out.token_ids


# -- offline ----------------------------------------------------------------------------------------


@fuzz_settings
@given(field=st.sampled_from((*FLOAT_FIELDS, "logit_bias")), value=extreme_floats)
def test_offline_extreme_floats_are_refused_by_name_or_sample_valid_tokens(tiny_llm, field, value):
    try:
        params = SamplingParams(**params_for(field, value), logprobs=1)
    except ValueError as e:
        assert str(e).startswith(f"{field}: "), e
        assert not math.isfinite(value) or field != "temperature" or value < 0 or value > 100
        return
    tokens = assert_valid(tiny_llm, params)
    if field == "temperature" and value < SAMPLING_EPS:
        assert tokens == greedy_tokens(tiny_llm)  # 1e-300, subnormals and -0.0 are greedy


@fuzz_settings
@given(
    values=st.fixed_dictionaries({}, optional={f: extreme_floats for f in FLOAT_FIELDS}),
    top_k=st.sampled_from([-1, 0, 1, 2, 50, 10**6]),
    allowed=st.none() | st.lists(st.integers(0, 49151), min_size=1, max_size=5),
    min_tokens=st.integers(0, N_OUT),
    seed=st.none() | st.integers(0, 2**63 - 1),
)
def test_offline_every_field_at_once(tiny_llm, values, top_k, allowed, min_tokens, seed):
    """Several extreme fields together (penalties on top of a tiny temperature and top_p, a mask):
    refused naming one of them, or valid tokens from the allowed ones."""
    try:
        params = SamplingParams(max_tokens=N_OUT, ignore_eos=True, top_k=top_k, allowed_token_ids=allowed,
                                min_tokens=min_tokens, seed=seed, logprobs=1, **values)
    except ValueError as e:
        assert str(e).split(":")[0] in values, e
        return
    assert_valid(tiny_llm, params)


def test_a_temperature_below_the_epsilon_is_greedy_and_above_it_is_not(tiny_llm):
    greedy = greedy_tokens(tiny_llm)
    for t in (1e-300, 5e-324, 9.99e-6, -0.0):
        assert SamplingParams(temperature=t).greedy
        assert assert_valid(tiny_llm, SamplingParams(temperature=t, max_tokens=N_OUT, ignore_eos=True)) == greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"repetition_penalty": 1e-300}, "repetition_penalty: must be in [0.01, 10]"),  # was accepted: inf logits
        ({"repetition_penalty": 0.0099}, "repetition_penalty: must be in [0.01, 10]"),
        ({"repetition_penalty": 10.5}, "repetition_penalty: must be in [0.01, 10]"),
        ({"allowed_token_ids": []}, "allowed_token_ids: must list 1 to"),
        ({"allowed_token_ids": [5, -1]}, "allowed_token_ids: must be non-negative token ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids: must be non-negative token ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids: must be a list of token ids"),
    ],
)
def test_sampling_params_refuse_unsafe_values_naming_the_field(kw, says):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(says), e.value


def test_offline_allowed_token_ids_outside_the_vocabulary_are_refused(tiny_llm):
    vocab = tiny_llm.engine.vocab_size
    with pytest.raises(ValueError, match=rf"^allowed_token_ids: token id {vocab} is outside the vocabulary"):
        tiny_llm.generate(PROMPT, SamplingParams(allowed_token_ids=[1, vocab]), use_tqdm=False)
    p = SamplingParams(allowed_token_ids=[17, 23], max_tokens=N_OUT, ignore_eos=True, temperature=1.0, seed=3)
    assert set(assert_valid(tiny_llm, p)) <= {17, 23}


# -- served -----------------------------------------------------------------------------------------


def post(client, body: dict):
    return client.post("/v1/completions", content=encode(body), headers={"Content-Type": "application/json"})


def check_completion(r, n_out: int = N_OUT) -> dict:
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    assert body["usage"]["completion_tokens"] == n_out and choice["finish_reason"] == "length"
    assert json_numbers_finite(body) and all(math.isfinite(x) for x in choice["logprobs"]["token_logprobs"])
    return choice


@fuzz_settings
@given(field=st.sampled_from((*FLOAT_FIELDS, "logit_bias")), value=extreme_floats)
def test_served_extreme_floats_are_a_400_naming_the_field_or_valid_tokens(app_client, field, value):
    body = {"prompt": PROMPT, "logprobs": 1, **params_for(field, value)}
    r = post(app_client, body)
    if r.status_code == 400:
        err = check_error(r.status_code, r.content)
        assert err["param"] is not None and err["param"].split(".")[0] == field, err
        return
    tokens = check_completion(r)["logprobs"]["tokens"]
    if field == "temperature" and value < SAMPLING_EPS:
        assert tokens == served_greedy(app_client)


_greedy: list[str] = []


def served_greedy(client) -> list[str]:
    """The tokens (as strings) the server answers at temperature 0, asked once."""
    if not _greedy:
        r = post(client, {"prompt": PROMPT, "logprobs": 1, **params_for("temperature", 0.0)})
        _greedy.extend(check_completion(r)["logprobs"]["tokens"])
    return _greedy


def test_served_tiny_temperature_is_greedy(app_client):
    for t in (1e-300, 5e-324, -0.0, 9.99e-6):
        choice = check_completion(post(app_client, {"prompt": PROMPT, "logprobs": 1, **params_for("temperature", t)}))
        assert choice["logprobs"]["tokens"] == served_greedy(app_client), t


@pytest.mark.parametrize(
    ("ids", "says"),
    [
        ([1, 49152], "allowed_token_ids: token id 49152 is outside the vocabulary (size 49152)"),  # was ignored
        ([10**12], "allowed_token_ids.0: Input should be less than or equal to 2147483647"),
        ([-1], "allowed_token_ids.0: Input should be greater than or equal to 0"),
        ([], "allowed_token_ids: List should have at least 1 item"),
    ],
)
def test_served_allowed_token_ids_outside_the_vocabulary_are_a_400(app_client, ids, says):
    r = post(app_client, {"prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": ids})
    err = check_error(r.status_code, r.content)
    assert r.status_code == 400 and err["param"].split(".")[0] == "allowed_token_ids", err
    assert err["message"].startswith(says), err


def test_served_allowed_token_ids_restrict_the_tokens(app_client):
    r = post(app_client, {"prompt": PROMPT, "max_tokens": N_OUT, "ignore_eos": True, "logprobs": 0,
                          "allowed_token_ids": [17, 23], "temperature": 1.0, "seed": 5})
    choice = check_completion(r)
    decode = app_client.app.state.engine.tokenizer.decode
    assert set(choice["logprobs"]["tokens"]) <= {decode([t], skip_special_tokens=False) for t in (17, 23)}
