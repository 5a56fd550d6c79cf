"""The predicted time to first token against the engine's own run on the simulator's executor:
the same cost model charges the real steps on a virtual clock, so a prediction that plays the
scheduler's order of work forward must land on the first token's time (requests run to their
max_tokens, as the prediction assumes, since the simulated model emits no EOS)."""

from __future__ import annotations

import pytest
from fakes import make_request

from cadence.clock import VirtualClock
from cadence.config import EngineConfig
from cadence.engine.core import EngineCore
from cadence.engine.ttft import TTFTPredictor, load_cost_profile
from cadence.executor.cost_model import SimExecutor, StepCostModel
from cadence.request import SamplingParams
from cadence.sim.profile import default_profile_path


def _engine(**options) -> tuple[EngineCore, TTFTPredictor, VirtualClock]:
    model = StepCostModel.load(default_profile_path())
    clock = VirtualClock(1.0)
    options.setdefault("num_kv_blocks", 512)
    options.setdefault("block_size", 16)
    core = EngineCore(EngineConfig.from_options(**options), SimExecutor(model, clock=clock), clock=clock,
                      max_model_len=4096, check_integrity=True)
    return core, TTFTPredictor(model, str(default_profile_path())), clock


def _first_token_time(core: EngineCore, rid: str, limit: int = 100_000) -> float:
    req = core.scheduler.requests[rid]
    for _ in range(limit):
        if req.first_token_time is not None:
            return req.first_token_time - req.arrival_time
        core.step()
    raise AssertionError("no first token")


def _req(prompt_len: int, max_tokens: int, **fields):
    return make_request(prompt_len, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), **fields)


@pytest.mark.parametrize("options", [
    {"max_num_seqs": 4, "max_num_batched_tokens": 256},  # waits for a sequence slot
    {"max_num_seqs": 64, "max_num_batched_tokens": 128},  # waits behind long prompts (the token budget)
    {"max_num_seqs": 8, "max_num_batched_tokens": 512, "long_prefill_token_threshold": 64,
     "max_num_partial_prefills": 2},
])
def test_the_prediction_lands_on_the_simulated_first_token(options) -> None:
    core, predictor, clock = _engine(**options)
    reqs = [_req(100 + 37 * i, 20 + 11 * (i % 5)) for i in range(16)]
    for r in reqs:
        core.add_request(r)
    for _ in range(3):
        core.step()
    waiting = [r for r in reqs if r.first_scheduled_time is None]
    assert len(waiting) >= 3, "the case must leave requests waiting"
    targets = [waiting[0], waiting[len(waiting) // 2], waiting[-1]]
    predicted = {r.request_id: predictor.predict(core.scheduler, r, clock.now()) for r in targets}
    for r in targets:
        p = predicted[r.request_id]
        assert p.unavailable is None and p.ttft_s is not None, p
        actual = _first_token_time(core, r.request_id)
        assert p.ttft_s == pytest.approx(actual, rel=0.05), (r.request_id, p, actual)


def test_a_request_in_prefill_is_predicted_from_its_remaining_chunks() -> None:
    core, predictor, clock = _engine(max_num_batched_tokens=64, max_num_seqs=4)
    big = _req(1000, 5)
    core.add_request(big)
    core.step()
    core.step()
    assert core.scheduler.snapshot(big.request_id).state == "prefilling"
    p = predictor.predict(core.scheduler, big, clock.now())
    assert p.ttft_s == pytest.approx(_first_token_time(core, big.request_id), rel=0.02)


def test_prefix_cache_hits_shorten_the_prediction() -> None:
    core, predictor, clock = _engine(max_num_batched_tokens=256, max_num_seqs=2)
    shared = list(range(1, 801))
    first = _req(0, 2, prompt=shared + [900])
    core.add_request(first)
    _first_token_time(core, first.request_id)
    while core.has_unfinished_requests():
        core.step()
    again = _req(0, 2, prompt=shared + [901])
    other = _req(0, 2, prompt=[5] * 800 + [901])
    core.add_request(again)
    core.add_request(other)
    hit = predictor.predict(core.scheduler, again, clock.now())
    miss_ahead = predictor.predict(core.scheduler, other, clock.now())
    assert hit.in_s is not None and miss_ahead.in_s is not None
    assert hit.in_s < 0.5 * (miss_ahead.in_s - hit.in_s)  # 16 tokens to compute against 801
    assert hit.ttft_s == pytest.approx(_first_token_time(core, again.request_id), rel=0.05)


def test_no_prediction_once_the_first_token_is_out_or_with_static_batches() -> None:
    core, predictor, clock = _engine()
    r = _req(20, 5)
    core.add_request(r)
    _first_token_time(core, r.request_id)
    assert predictor.predict(core.scheduler, r, clock.now()).unavailable == "its first token is out"
    static, predictor, clock = _engine(scheduler="static")
    s = _req(20, 5)
    static.add_request(s)
    assert "static" in (predictor.predict(static.scheduler, s, clock.now()).unavailable or "")


def test_the_cost_profile_option() -> None:
    assert load_cost_profile("none") is None
    shipped = load_cost_profile(None)
    assert shipped is not None and shipped.source == str(default_profile_path())
    with pytest.raises(ValueError, match="--cost-profile /nonexistent.json: cannot read it"):
        load_cost_profile("/nonexistent.json")


def test_a_file_that_is_not_a_profile_is_refused_by_name(tmp_path) -> None:
    bad = tmp_path / "p.json"
    for text in ("[1, 2]", "{\"cadence_profile\": 1}", "not json"):
        bad.write_text(text)
        with pytest.raises(ValueError, match="--cost-profile"):
            load_cost_profile(str(bad))


def test_a_profile_from_another_machine_says_so() -> None:
    model = StepCostModel.load(default_profile_path())
    model.metadata["machine"] = {"cpu": "Imaginary CPU 9000", "cpu_count": 4096, "machine": "x86_64"}
    d = TTFTPredictor(model, "p.json").describe("SmolLM2-135M-Instruct")
    assert d["calibrated_here"] is False and "another machine" in d["note"]
    assert d["model"] == "SmolLM2-135M-Instruct" and d["path"] == "p.json"
