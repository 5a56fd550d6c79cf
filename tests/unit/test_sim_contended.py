"""Replicas contending for one machine's cores (`SimOptions.contended_overhead`, `cadence sim
--contended-overhead`): a replica's step pays the fleet's overhead only while the other replicas
compute, by hand."""

from __future__ import annotations

import pytest

from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel
from cadence.sim.cli import parse_contended
from cadence.sim.simulator import SimOptions, Simulator
from cadence.workload import Workload, WorkloadRequest

META = {"kv_bytes_per_token": 1000, "max_model_len": 4096}
STEP = 0.1
OWN = {"per_step": 0.01, "per_seq": 0.0}  # the profile's overhead: a replica computing alone
MODEL = StepCostModel("tokens", {"const": STEP}, META, overhead=OWN)  # 110 ms a step
SHARED = (0.05, 0.0)  # with the other replica busy, 50 ms a step in place of 10


def _run(arrivals: list[float], replicas: int = 2, co: tuple[float, float] | None = SHARED, out: int = 3):
    reqs = tuple(WorkloadRequest(arrival_time=t, prompt_tokens=10, output_tokens=out) for t in arrivals)
    sim = Simulator(EngineConfig.from_options(num_kv_blocks=2048), MODEL,
                    SimOptions(replicas=replicas, router="round-robin", contended_overhead=co))
    return sim.run(Workload("t", reqs, prefix_block_tokens=16)).records


def test_a_replica_computing_alone_pays_the_profile_s_overhead() -> None:
    # far apart: each request's replica computes while the other idles
    a, b = _run([0.0, 100.0])
    assert a.token_times == pytest.approx([0.11, 0.22, 0.33])
    assert b.e2e == pytest.approx(0.33)


def test_both_replicas_busy_pay_the_contended_overhead_at_every_step() -> None:
    # at once, one on each replica: every step of each has the other computing
    a, b = _run([0.0, 0.0])
    assert a.token_times == pytest.approx([0.15, 0.30, 0.45])
    assert b.token_times == pytest.approx([0.15, 0.30, 0.45])


def test_overlap_pays_only_for_the_steps_it_overlaps() -> None:
    # b (4 tokens) outlives a (2 tokens): its last steps run alone
    reqs = (WorkloadRequest(arrival_time=0.0, prompt_tokens=10, output_tokens=2),
            WorkloadRequest(arrival_time=0.0, prompt_tokens=10, output_tokens=4))
    sim = Simulator(EngineConfig.from_options(num_kv_blocks=2048), MODEL,
                    SimOptions(replicas=2, router="round-robin", contended_overhead=SHARED))
    a, b = sim.run(Workload("t", reqs, prefix_block_tokens=16)).records
    assert a.token_times == pytest.approx([0.15, 0.30])
    # b's third step starts at 0.30, as a's replica has finished: alone again, 110 ms a step
    assert b.token_times == pytest.approx([0.15, 0.30, 0.41, 0.52])


def test_without_it_or_without_a_fleet_nothing_changes() -> None:
    assert [r.token_times for r in _run([0.0, 0.0], co=None)] == [pytest.approx([0.11, 0.22, 0.33])] * 2
    (alone,) = _run([0.0], replicas=1)
    assert alone.token_times == pytest.approx([0.11, 0.22, 0.33])


def test_the_option_and_the_flag_refuse_what_is_not_two_non_negative_terms() -> None:
    with pytest.raises(ValueError, match="contended_overhead"):
        SimOptions(contended_overhead=(-0.001, 0.0)).validate()
    assert parse_contended(None) is None
    assert parse_contended("6") == pytest.approx((0.006, None))  # the profile's per running request
    assert parse_contended("6,0.2") == pytest.approx((0.006, 0.0002))
    for bad in ("x", "6,1,2", "-1", "nan", "inf", "1e309", "", "5,", "20000"):
        with pytest.raises(ValueError, match="--contended-overhead: expected MS or MS,MS, each 0 to 10000 ms"):
            parse_contended(bad)


def test_a_step_term_alone_keeps_the_profile_s_per_request_overhead() -> None:
    model = StepCostModel("tokens", {"const": STEP}, META, overhead={"per_step": 0.0, "per_seq": 0.02})
    reqs = tuple(WorkloadRequest(arrival_time=0.0, prompt_tokens=10, output_tokens=2) for _ in range(2))

    def run(co):
        sim = Simulator(EngineConfig.from_options(num_kv_blocks=2048), model,
                        SimOptions(replicas=2, router="round-robin", contended_overhead=co))
        return [r.token_times for r in sim.run(Workload("t", reqs, prefix_block_tokens=16)).records]

    # one row a step: 100 + 20 ms alone; with the other busy 30 ms a step more, the row's 20 kept
    assert run((0.03, None))[0] == pytest.approx([0.15, 0.30])
    assert run((0.03, 0.0))[0] == pytest.approx([0.13, 0.26])  # given as 0: the row's 20 ms gone


@pytest.mark.parametrize(("argv", "says"), [
    (["sim", "--workload", "chat", "--num-requests", "4", "--contended-overhead", "6"],
     "--contended-overhead: prices replicas contending for one machine's cores: it needs --replicas 2 or more"),
    (["sim", "--workload", "chat", "--num-requests", "4", "--prefill-replicas", "1", "--decode-replicas", "1",
      "--contended-overhead", "6"], "(not a P/D fleet)"),
    (["sim", "plan", "--workload", "chat", "--num-requests", "4", "--rate", "1", "--slo", "ttft_p95=1",
      "--contended-overhead", "6"], "--contended-overhead: `cadence sim plan` sizes fleets of replicas"),
])
def test_the_flag_is_refused_where_no_replicas_contend(argv: list[str], says: str, capsys) -> None:
    from cadence.cli import main

    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_the_flag_simulates_a_fleet_sharing_cores(tmp_path, capsys) -> None:
    from cadence.cli import main

    common = ["sim", "--workload", "chat", "--num-requests", "8", "--rate", "4", "--replicas", "2", "--seed", "3"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--contended-overhead", "20", "--out", str(tmp_path / "b")]) == 0
    import json

    alone, shared = (json.loads((tmp_path / d / "summary.json").read_text())["overall"]["itl"]["p50"] for d in "ab")
    assert shared > alone  # 20 ms a step while the other replica computes
    notes = json.loads((tmp_path / "b" / "summary.json").read_text())["meta"]["notes"]
    assert any("replicas contend for cores: 20 ms a step" in n for n in notes), notes
    assert "replicas contend for cores" in capsys.readouterr().out


def test_a_bad_value_is_one_line_naming_the_flag(capsys) -> None:
    from cadence.cli import main

    argv = ["sim", "--workload", "chat", "--num-requests", "4", "--replicas", "2", "--contended-overhead", "nan"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--contended-overhead: expected MS or MS,MS" in err[0], err
