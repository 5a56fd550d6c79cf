"""`cadence sim` with speculative decoding: the same scheduler, drafts accepted at a configured
rate by the SimExecutor, verification rows priced by the cost model."""

from __future__ import annotations

import pytest

from cadence.config import EngineConfig
from cadence.engine.core import EngineCore
from cadence.executor.cost_model import SimExecutor, SpecAcceptance, StepCostModel
from cadence.request import Request, SamplingParams
from cadence.sched.adaptive import DraftModelCost
from cadence.sim.profile import shipped_profile
from cadence.sim.simulator import SimOptions, Simulator
from cadence.workload import Workload, WorkloadRequest

META = {"kv_bytes_per_token": 1000, "max_model_len": 4096}
# 10 ms a step plus 0.1 ms a token: a row of drafts costs little more than a decode.
CHEAP = StepCostModel("tokens", {"const": 0.01, "num_tokens": 0.0001}, META)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _sim(n: int, spec: dict | None, rate: str | None, model: StepCostModel = CHEAP, out: int = 48, **opts):
    config = EngineConfig.from_options(num_kv_blocks=4096, speculative_config=spec, max_num_seqs=128)
    # Per all-decode step (no prompt chunk): the requests running after it, the draft tokens it verified.
    drafts: list[tuple[int, int]] = []

    def on_step(_: int, core: EngineCore, __: float) -> None:
        st = core.last_stats
        if not st.num_prompt_tokens:
            drafts.append((len(core.scheduler.running), st.num_draft_tokens))

    acc = None if rate is None else SpecAcceptance.parse(rate)
    sim = Simulator(config, model, SimOptions(spec_acceptance=acc, **opts), on_step=on_step)
    reqs = tuple(WorkloadRequest(arrival_time=0.0, prompt_tokens=40, output_tokens=out) for _ in range(n))
    return sim.run(Workload("t", reqs, prefix_block_tokens=16)), drafts


def _tokens(spec: dict | None, rate: str) -> list[list[int]]:
    """Token ids from an engine core on the SimExecutor (the simulator's records keep counts only)."""
    config = EngineConfig.from_options(num_kv_blocks=512, speculative_config=spec)
    ex = SimExecutor(CHEAP, spec_acceptance=SpecAcceptance.parse(rate), seed=3)
    core = EngineCore(config, ex, max_model_len=4096, eos_token_ids=frozenset())
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        core.add_request(Request(f"r{i}", [5, 6, 7, 13, 13, 8 + i], params))
    out: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return [out[f"r{i}"] for i in range(3)]


@pytest.mark.parametrize("adaptive", [True, False])
def test_acceptance_zero_gives_the_run_without_speculation(adaptive: bool) -> None:
    spec = {**SPEC, "adaptive": adaptive}
    assert _tokens(spec, "0") == _tokens(None, "0")
    plain, _ = _sim(6, None, None, fast_forward=False)
    got, drafts = _sim(6, spec, "0")
    assert sum(d for _, d in drafts) > 0  # drafts were verified, and all rejected
    assert [r.output_tokens for r in got.records] == [r.output_tokens for r in plain.records] == [48] * 6


def test_acceptance_one_finishes_in_fewer_steps() -> None:
    plain, _ = _sim(2, None, None, fast_forward=False)
    got, drafts = _sim(2, SPEC, "1")
    assert [r.output_tokens for r in got.records] == [48, 48]
    assert got.steps < plain.steps * 0.5
    assert max(r.e2e for r in got.records) < max(r.e2e for r in plain.records)


def test_the_same_seed_gives_the_same_run_and_rates_shape_the_acceptance() -> None:
    a, da = _sim(3, {**SPEC, "adaptive": False}, "0.9,0.5,0.2", seed=7)
    b, db = _sim(3, {**SPEC, "adaptive": False}, "0.9,0.5,0.2", seed=7)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records] and da == db
    high, _ = _sim(3, {**SPEC, "adaptive": False}, "0.95")
    assert high.steps < a.steps


def test_adaptive_k_drops_to_zero_in_the_simulator_under_heavy_load() -> None:
    path = shipped_profile("default")
    assert path is not None
    profile = StepCostModel.load(path)
    _, alone = _sim(1, SPEC, "0.9", model=profile)
    assert sum(d for _, d in alone) > 0  # one stream speculates
    _, heavy = _sim(64, SPEC, "0.9", model=profile)
    assert sum(d for rows, d in heavy if rows >= 32) == 0
    _, fixed = _sim(64, {**SPEC, "adaptive": False}, "0.9", model=profile)
    assert sum(d for rows, d in fixed if rows >= 32) > 0  # fixed k keeps verifying drafts


def test_bad_acceptance_rates_are_refused_by_name() -> None:
    for text in ("1.5", "0.5,0.7", "x"):
        with pytest.raises(ValueError, match="spec_acceptance_rate"):
            SpecAcceptance.parse(text)
    with pytest.raises(ValueError, match=r"spec_acceptance_rate \(--spec-acceptance-rate\): required"):
        Simulator(EngineConfig.from_options(speculative_config=SPEC), CHEAP)


DRAFT_MODEL = {"method": "draft_model", "model": "unused: the simulator draws acceptance", "num_speculative_tokens": 4,
               "adaptive": False}


def test_a_draft_model_speculates_in_the_simulator_at_the_given_rate() -> None:
    """method draft_model: the SimExecutor answers the scheduler's draft requests, so rows of
    drafts are verified at the rate given; output does not change, the steps fall."""
    assert _tokens(DRAFT_MODEL, "0.8") == _tokens(None, "0")
    plain, _ = _sim(2, None, None, fast_forward=False)
    got, drafts = _sim(2, DRAFT_MODEL, "1", spec_draft_ratio=0.1)
    assert sum(d for _, d in drafts) > 0
    assert [r.output_tokens for r in got.records] == [48, 48]
    assert got.steps < plain.steps * 0.5


def test_the_draft_models_time_is_charged_per_step_as_the_scheduler_prices_it() -> None:
    """With a draft model, each step costs the served model's step plus `DraftModelCost.total` of the
    requests drafted for after it (the function adaptive k weighs drafting with), at their rows'
    contexts; the scheduler's adaptive k gets the same ratio."""
    class Recording(SimExecutor):
        def execute(self, scheduler_output):  # type: ignore[no-untyped-def]
            got = super().execute(scheduler_output)
            charged.append((scheduler_output, self.last_step_cost))
            return got

    charged: list = []
    drafting = DraftModelCost(0.25, 4)
    config = EngineConfig.from_options(num_kv_blocks=512, speculative_config={**DRAFT_MODEL, "adaptive": True})
    ex = Recording(CHEAP, spec_acceptance=SpecAcceptance.parse("0.5"), seed=1, draft_cost=drafting)
    core = EngineCore(config, ex, max_model_len=4096, eos_token_ids=frozenset())
    core.scheduler.speculation.draft_cost_ratio = drafting.ratio
    for i in range(3):
        core.add_request(Request(f"r{i}", list(range(10 + i)), SamplingParams(max_tokens=20, temperature=0.0,
                                                                           ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    drafted = 0
    for out, cost in charged:
        contexts = [r.start_pos + 1 for r in out.scheduled if r.request_id in out.draft_requests]
        drafted += len(contexts)
        want = CHEAP.cost(out) + drafting.total(CHEAP.predict, len(contexts), sum(contexts), max(contexts, default=0))
        assert cost == pytest.approx(want, rel=1e-12)
    assert drafted > 0 and drafting.total(CHEAP.predict, 1, 11, 11) > 0
    # The simulator requires the ratio with a draft model, and gives it to adaptive k.
    with pytest.raises(ValueError, match="spec_draft_ratio"):
        _sim(2, DRAFT_MODEL, "1")
    sim = Simulator(EngineConfig.from_options(num_kv_blocks=512, speculative_config=DRAFT_MODEL), CHEAP,
                    SimOptions(spec_acceptance=SpecAcceptance.parse("1"), spec_draft_ratio=0.25))
    assert all(r.core.scheduler.speculation.draft_cost_ratio == 0.25 for r in sim.replicas)
    slow, _ = _sim(2, DRAFT_MODEL, "1", spec_draft_ratio=0.5)
    fast, _ = _sim(2, DRAFT_MODEL, "1", spec_draft_ratio=0.05)
    assert slow.steps == fast.steps and slow.virtual_s > fast.virtual_s  # fixed k: the same steps, dearer
