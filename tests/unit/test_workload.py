"""The workload format: requests, built-in mixes, arrival processes, trace readers, JSONL."""

from __future__ import annotations

import ast
import math
import statistics
import sys
from pathlib import Path

import pytest

import cadence.workload as workload_module
from cadence.workload import (
    BUILTIN_WORKLOADS,
    Scaling,
    Workload,
    WorkloadRequest,
    arrival_times,
    assign_arrivals,
    builtin_workload,
    load_trace,
    read_azure_csv,
    read_jsonl,
    read_mooncake_jsonl,
    scale_workload,
    shared_prefix_blocks,
    write_jsonl,
)

TRACES = Path(__file__).resolve().parents[2] / "traces"  # shipped in the repository


def trace(name: str) -> Path:
    p = TRACES / name
    assert p.is_file(), f"trace {p} missing from the repository"
    return p


# --- requests and JSONL --------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    {"prompt_tokens": 0, "output_tokens": 1},
    {"prompt_tokens": 5, "output_tokens": 0},
    {"prompt_tokens": 5, "output_tokens": 1, "arrival_time": -1.0},
    {"prompt_tokens": 5, "output_tokens": 1, "arrival_time": math.nan},
    {"prompt_tokens": 5, "output_tokens": 1, "deadline": 0.0},
    {"prompt_tokens": 5, "output_tokens": 1, "tenant": ""},
])
def test_bad_requests_raise_value_error(kw: dict) -> None:
    with pytest.raises(ValueError):
        WorkloadRequest(**kw)


def test_jsonl_round_trip_keeps_every_field(tmp_path: Path) -> None:
    reqs = (
        WorkloadRequest(arrival_time=0.5, prompt_tokens=10, output_tokens=3, prefix_group=(1, 2), tenant="a",
                        priority=2, deadline=4.0),
        WorkloadRequest(prompt_tokens=7, output_tokens=1, prompt="Hello there."),
        WorkloadRequest(prompt_tokens=4, output_tokens=2, messages=(("system", "Be brief."), ("user", "Hi"))),
    )
    w = Workload("mine", reqs, prefix_block_tokens=32, notes=("hand made",))
    write_jsonl(w, tmp_path / "w.jsonl")
    back = read_jsonl(tmp_path / "w.jsonl")
    assert back == w


def test_user_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt_tokens": 3, "output_tokens": 2}\n{"prompt_tokens": 3, "colour": "red"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: unknown fields \['colour'\]"):
        read_jsonl(p)


_OK = '{"prompt_tokens": 3, "output_tokens": 2}'


@pytest.mark.parametrize(("line", "says"), [
    ('{"prompt_tokens": 3, "output_tokens": 2, "messages": [{"role": "user"}]}',
     r"messages\[0\]: expected \{'role': str, 'content': str\}"),  # was "'content'" (a KeyError)
    ('{"prompt_tokens": 3, "output_tokens": 2, "prefix_group": ["a"]}', "prefix_group: must be a list of integer"),
    ('{"prompt_tokens": 3, "output_tokens": 2, "arrival_time": "soon"}', "arrival_time: must be a finite number"),
    ('{"prompt_tokens": 3, "output_tokens": 2, "prompt": 5}', "prompt: must be a string"),
    ('{"prompt_tokens": true, "output_tokens": 2}', "prompt_tokens: must be an integer"),
    ('{"cadence_workload": 1, "prefix_block_tokens": "big"}', "prefix_block_tokens: must be an integer"),
    ('{not json', "not JSON"),
])
def test_user_jsonl_field_errors_name_the_line_and_field(tmp_path: Path, line: str, says: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(f"{_OK}\n{line}\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: " + says):
        read_jsonl(p)


@pytest.mark.parametrize(("rows", "says"), [
    ("2023-11-16 18:17:03.1,100,10\n2023-11-16 18:17:04.5,abc,10", "t.csv:3: ContextTokens: expected a whole number"),
    ("not-a-time,100,10", "t.csv:2: TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS"),
    ("2023-11-16 18:17:03.1,100,10\n2023-11-16 18:17:04.5,50", "t.csv:3: expected 3 columns"),
    ("2023-11-16 18:17:03.1,100,-4", "t.csv:2: GeneratedTokens: must be >= 0"),
])
def test_azure_csv_errors_name_the_line_and_column(tmp_path: Path, rows: str, says: str) -> None:
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows + "\n")
    with pytest.raises(ValueError, match=says):  # were int()/strptime messages naming neither
        read_azure_csv(p)


@pytest.mark.parametrize(("line", "says"), [
    ('{"timestamp": "x", "input_length": 100, "output_length": 10}', "timestamp: must be a number >= 0"),
    ('{"timestamp": -5, "input_length": 100, "output_length": 10}', "timestamp: must be a number >= 0"),
    ('{"timestamp": 5, "output_length": 10}', "input_length: missing"),
    ('{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": "ab"}', "hash_ids: must be a list"),
    ('{"timestamp": 5, "input_length": 100', "not JSON"),
])
def test_mooncake_errors_name_the_line_and_field(tmp_path: Path, line: str, says: str) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 100, "output_length": 10}\n' + line + "\n")
    with pytest.raises(ValueError, match="m.jsonl:2: .*" + says):
        read_mooncake_jsonl(p)


def test_explicit_prompt_without_size_is_estimated(tmp_path: Path) -> None:
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "' + "word " * 20 + '", "output_tokens": 2}\n')
    (r,) = read_jsonl(p).requests
    assert r.prompt_tokens == 25  # 100 characters at 4 per token


# --- built-in workloads ----------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTIN_WORKLOADS)
def test_builtins_are_deterministic_per_seed(name: str) -> None:
    assert builtin_workload(name, 50, seed=1) == builtin_workload(name, 50, seed=1)
    assert builtin_workload(name, 50, seed=1).requests != builtin_workload(name, 50, seed=2).requests
    assert all(r.arrival_time is None for r in builtin_workload(name, 50).requests)


def test_builtin_shapes() -> None:
    chat = builtin_workload("chat", 2000).requests
    outs = sorted(r.output_tokens for r in chat)
    assert outs[len(outs) // 2] < 100 and outs[-1] >= 400  # short median, long tail
    shared = builtin_workload("shared-prefix", 50).requests
    assert len({r.prefix_group for r in shared}) == 1 and shared[0].prefix_group
    long_mix = builtin_workload("long-prompt-mix", 2000).requests
    share = sum(r.prompt_tokens >= 1024 for r in long_mix) / len(long_mix)
    assert 0.15 < share < 0.25
    tenants = builtin_workload("mixed-tenants", 2000).requests
    batch = [r for r in tenants if r.tenant == "batch"]
    assert 0.55 < len(batch) / len(tenants) < 0.65
    assert all(r.priority == 1 and r.deadline is None for r in batch)
    others = [r for r in tenants if r.tenant != "batch"]
    assert {r.tenant for r in others} == {"alpha", "beta", "gamma"}
    assert all(r.priority == 0 and r.deadline is not None for r in others)


def test_unknown_builtin_raises() -> None:
    with pytest.raises(ValueError, match="workload"):
        builtin_workload("nope")


# --- arrival processes -----------------------------------------------------------------------


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_poisson_mean_gap_and_cv() -> None:
    gaps = _gaps(arrival_times(20001, "poisson", rate=4.0, seed=7))
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_is_the_shape_as_in_vllm(burstiness: float) -> None:
    """vLLM's --burstiness is the gamma shape k: gaps of mean 1/rate and coefficient of variation
    1/sqrt(k), so k < 1 is burstier than Poisson and k > 1 smoother."""
    gaps = _gaps(arrival_times(40001, "gamma", rate=2.0, seed=3, burstiness=burstiness))
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(burstiness ** -0.5, rel=0.08)
    assert (cv > 1) == (burstiness < 1)


def test_infinite_rate_puts_every_arrival_at_zero() -> None:
    timed = assign_arrivals(builtin_workload("chat", 7), "poisson", rate=float("inf"))
    assert [r.arrival_time for r in timed.requests] == [0.0] * 7
    assert "all 7 requests arrive at time 0" in timed.notes[-1]


def test_arrivals_are_seeded_and_start_at_zero() -> None:
    a = arrival_times(100, "poisson", 3.0, seed=1)
    assert a == arrival_times(100, "poisson", 3.0, seed=1) != arrival_times(100, "poisson", 3.0, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))


def test_assign_arrivals_modes() -> None:
    w = builtin_workload("chat", 20)
    timed = assign_arrivals(w, "gamma", rate=5.0, seed=0, burstiness=0.5)
    assert all(r.arrival_time is not None for r in timed.requests)
    assert "gamma arrivals at 5 req/s" in timed.notes[-1]
    assert all(r.arrival_time is None for r in assign_arrivals(timed, "none").requests)
    assert assign_arrivals(timed, "trace") is timed
    with pytest.raises(ValueError, match="without arrival times"):
        assign_arrivals(w, "trace")
    with pytest.raises(ValueError, match="rate"):
        assign_arrivals(w, "poisson")
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, "poisson", rate=0.0, seed=0)


# --- traces ----------------------------------------------------------------------------------


def test_azure_conv_trace() -> None:
    w = read_azure_csv(trace("azure_llm_2023_conv.csv"))
    assert len(w) == 19366
    r0, r1 = w.requests[:2]
    assert (r0.arrival_time, r0.prompt_tokens, r0.output_tokens) == (0.0, 374, 44)
    # 18:15:50.9951690 - 18:15:46.6805900
    assert r1.arrival_time == pytest.approx(4.314579, abs=1e-6)
    assert all(a.arrival_time <= b.arrival_time for a, b in zip(w.requests, w.requests[1:], strict=False))


def test_azure_code_trace_scaled_deterministically() -> None:
    s = Scaling(length_scale=0.05, max_prompt_tokens=128, max_output_tokens=16, time_scale=0.5, limit=100)
    a = load_trace(trace("azure_llm_2023_code.csv"), s)
    assert a == load_trace(trace("azure_llm_2023_code.csv"), s)
    raw = read_azure_csv(trace("azure_llm_2023_code.csv")).requests[:100]
    assert len(a) == 100
    assert a.requests[0].prompt_tokens == min(128, round(4808 * 0.05))
    for r, o in zip(a.requests, raw, strict=True):
        assert r.prompt_tokens == min(128, max(1, round(o.prompt_tokens * 0.05)))
        assert r.output_tokens == min(16, o.output_tokens)
        assert r.arrival_time == pytest.approx(o.arrival_time * 0.5)
    assert "x0.05" in a.notes[-1] and "x0.5" in a.notes[-1]


def test_mooncake_trace_and_shared_prefixes() -> None:
    w = read_mooncake_jsonl(trace("mooncake_synthetic_trace.jsonl"))
    assert len(w) == 3993 and w.prefix_block_tokens == 512
    assert w.requests[2].arrival_time == pytest.approx(0.040)
    assert len(w.requests[0].prefix_group) == 79
    head = w.requests[:300]
    pairs = [(a, b) for i, a in enumerate(head) for b in head[:i] if shared_prefix_blocks(a.prefix_group, b.prefix_group)]
    assert pairs, "the trace's first 300 requests share prefixes"
    s = Scaling(length_scale=0.05, max_prompt_tokens=512, time_scale=0.1, limit=300)
    scaled = load_trace(trace("mooncake_synthetic_trace.jsonl"), s)
    assert scaled.prefix_block_tokens == round(512 * 0.05)
    for r in scaled.requests:
        assert len(r.prefix_group) == math.ceil(r.prompt_tokens / scaled.prefix_block_tokens)
    # Scaling keeps every shared prefix that still fits in the clamped prompts.
    for i, a in enumerate(scaled.requests):
        for j in range(i):
            b = scaled.requests[j]
            raw = shared_prefix_blocks(head[i].prefix_group, head[j].prefix_group)
            assert shared_prefix_blocks(a.prefix_group, b.prefix_group) == min(raw, len(a.prefix_group), len(b.prefix_group))


def test_load_trace_detects_workload_jsonl(tmp_path: Path) -> None:
    w = builtin_workload("shared-prefix", 5)
    write_jsonl(w, tmp_path / "w.jsonl")
    assert load_trace(tmp_path / "w.jsonl").requests == w.requests
    assert scale_workload(w, Scaling()) is w


def test_bad_scaling_raises() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        Scaling(time_scale=0)
    with pytest.raises(ValueError, match="limit"):
        Scaling(limit=0)


def test_workload_module_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(workload_module.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - set(sys.stdlib_module_names) <= {"__future__"}
