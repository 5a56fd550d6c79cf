"""The shipped cost profiles: a server prices with the one calibrated at its own thread count,
since what k more rows add to a one-row step (and so what a speculative draft is worth) changes
with the threads that share the step."""

from __future__ import annotations

import pytest

from cadence.engine.ttft import load_cost_profile
from cadence.executor.cost_model import StepCostModel, default_profile_path
from cadence.sched.features import StepFeatures
from cadence.sim.profile import shipped_profile, shipped_profiles


@pytest.mark.parametrize(("threads", "name"), [(None, "default.json"), (1, "default.json"),
                                               (2, "default_2threads.json"), (3, "default.json")])
def test_the_default_profile_is_the_one_of_the_thread_count_where_one_ships(threads, name) -> None:
    path = default_profile_path(threads)
    assert path.name == name
    predictor = load_cost_profile(None, threads)
    assert predictor is not None and predictor.source == str(path)


def test_each_default_profile_was_calibrated_at_the_threads_its_name_says() -> None:
    assert StepCostModel.load(default_profile_path()).metadata["torch_threads"] == 1
    assert StepCostModel.load(default_profile_path(2)).metadata["torch_threads"] == 2
    assert "default-2threads" in shipped_profiles() and shipped_profile("default-2threads") == default_profile_path(2)


def test_two_threads_price_more_rows_cheaper_beside_one_than_one_thread_does() -> None:
    def ratio(model: StepCostModel) -> float:
        one = StepFeatures(decode_seqs=1, sampled=1, decode_context=601, decode_padded=601)
        five = StepFeatures(decode_seqs=5, sampled=5, decode_context=5 * 601 + 10, decode_padded=5 * 605)
        return model.predict(five) / model.predict(one)

    assert ratio(StepCostModel.load(default_profile_path(2))) < ratio(StepCostModel.load(default_profile_path()))


def test_an_explicit_profile_wins_over_the_thread_count(tmp_path) -> None:
    predictor = load_cost_profile(str(default_profile_path()), 2)
    assert predictor is not None and predictor.source == str(default_profile_path())
    assert load_cost_profile("none", 2) is None
