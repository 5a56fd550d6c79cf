"""The request path taken from served traffic: each request's time to first token less its queue
wait, its own prompt step (as measured) and the engine's overhead on that step."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.sim.profile import default_profile_path
from cadence.sim.served_fit import refit
from cadence.sim.served_path import MIN_REQUESTS, first_tokens, fit_served_path, run_first_tokens

OVERHEAD = {"per_step": 4e-4, "per_seq": 4e-5}
PER_REQUEST, PER_TOKEN = 0.006, 2.5e-6


def _chunk(m: int, cached: int, decodes: int = 0) -> StepFeatures:
    return StepFeatures(prefill_tokens=m, prefill_seqs=1, decode_seqs=decodes, sampled=1 + decodes,
                        decode_context=300 * decodes, decode_padded=300 * decodes,
                        prefill_attention=m * cached + m * (m + 1) // 2)


def _decodes(n: int) -> StepFeatures:
    return StepFeatures(decode_seqs=n, sampled=n, decode_context=300 * n, decode_padded=300 * n)


def _served(rng: random.Random, probe_steps: int = 0) -> tuple[list[dict], list[tuple[StepFeatures, float]]]:
    """A served run as serving_breakdown.py keeps it: client records and the step log (the probe's
    steps first). Most requests get one lone chunk step (a shared 1024-token prefix cached, or
    none); one long prompt is chunked over two steps and two prompts share a step: those two kinds
    carry 50 ms more than the path, so a fit that took them in would show it."""
    steps: list[tuple[StepFeatures, float]] = [(_chunk(40, 0), 0.03)] * probe_steps
    records: list[dict] = []
    t = 0.0
    for i in range(40):
        t += 0.5
        shared = i % 2 == 0
        n = 1024 + rng.randint(8, 120) if shared else rng.randint(30, 300)
        cached = 1024 if shared else 0
        decodes = i % 3
        f, seconds = _chunk(n - cached, cached, decodes), rng.uniform(0.02, 0.1)
        steps += [(_decodes(2), 0.01), (f, seconds)]
        queue = rng.uniform(0.0, 0.02)
        ttft = PER_REQUEST + PER_TOKEN * n + queue + seconds + OVERHEAD["per_step"] + OVERHEAD["per_seq"] * f.num_seqs
        records.append({"index": i, "status": 200, "prompt_tokens": n, "send_time": t, "queue_time": queue,
                        "first_token_time": t + ttft})
    t += 0.5  # a long prompt in two chunks: its last chunk's m + cached is its prompt, but not its only step
    steps += [(_chunk(512, 0), 0.4), (_chunk(300, 512, 1), 0.3)]
    records.append({"index": 40, "status": 200, "prompt_tokens": 812, "send_time": t, "queue_time": 0.0,
                    "first_token_time": t + 0.75})
    t += 0.5  # two prompts in one step
    steps.append((StepFeatures(prefill_tokens=150, prefill_seqs=2, sampled=2, prefill_attention=5000), 0.1))
    for k, n in ((41, 70), (42, 80)):
        records.append({"index": k, "status": 200, "prompt_tokens": n, "send_time": t, "queue_time": 0.0,
                        "first_token_time": t + 0.16})
    return records, steps


def test_each_request_is_matched_to_its_own_prompt_step_and_its_path_is_what_is_left():
    records, steps = _served(random.Random(0))
    tokens = first_tokens(records, steps, OVERHEAD)
    # The chunked prompt and the two sharing a step are left out; every other request is found.
    assert len(tokens) == 40
    assert {t.prompt_tokens for t in tokens}.isdisjoint({812, 70, 80})
    for t in tokens:
        assert t.path == pytest.approx(PER_REQUEST + PER_TOKEN * t.prompt_tokens, abs=1e-9)
    assert {t.cached_tokens for t in tokens} == {0, 1024}
    fit = fit_served_path(tokens)
    assert fit == {"per_request": pytest.approx(PER_REQUEST, abs=1e-7), "per_prompt_token": pytest.approx(PER_TOKEN, rel=1e-3)}
    assert fit_served_path(tokens[: MIN_REQUESTS - 1]) is None  # too few: the probe decides


def _run(seed: int, steps: int, rows: int, probe: list[dict]) -> dict:
    outside = steps * OVERHEAD["per_step"] + rows * OVERHEAD["per_seq"]
    return {"seed": seed, "rate": 1.25, "fraction": 0.3, "steps": steps, "tokens_out": rows, "steps_vs_model": {},
            "phases_s": {"idle": 1.0, "execute": 5.0, "schedule_update": outside, "detokenize": 0.0, "publish": 0.0,
                         "inbox": 0.0},
            "request_path_probe": probe}


def _breakdown(tmp_path: Path, probe_path: float) -> Path:
    """A breakdown directory with two runs (two, so that the engine overhead's two terms are
    determined), each starting with an idle probe and then the traffic above."""
    probe = [{"words": 8, "prompt_tokens": 40, "cached_tokens": 32, "ttft_s": probe_path + 0.01} for _ in range(4)]
    runs = [_run(7, 2000, 4000, probe), _run(8, 1000, 6000, probe)]
    (tmp_path / "breakdown.json").write_text(json.dumps({"workload": "shared-prefix", "runs": runs}))
    for seed in (7, 8):
        records, steps = _served(random.Random(seed), probe_steps=1 + 2 * len(probe))
        with (tmp_path / f"steps_{seed}_1.250.jsonl").open("w") as f:
            for i, (feat, seconds) in enumerate(steps):
                f.write(json.dumps({"step": i, "duration": seconds, **feat.to_dict()}) + "\n")
        real = tmp_path / f"real_{seed}_1.250"
        real.mkdir()
        (real / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_a_refit_takes_the_request_path_from_the_served_requests_over_the_idle_probe(tmp_path):
    d = _breakdown(tmp_path, probe_path=0.0015)
    run = json.loads((d / "breakdown.json").read_text())["runs"][0]
    assert len(run_first_tokens(d, run, OVERHEAD)) == 40  # the probe's steps at the log's head are skipped
    base = dataclasses.replace(StepCostModel.load(default_profile_path()), request_path={"per_request": 0.5})
    new = refit(base, d)
    assert new.overhead == pytest.approx(OVERHEAD)
    assert new.request_path == {"per_request": pytest.approx(PER_REQUEST, abs=1e-7),
                                "per_prompt_token": pytest.approx(PER_TOKEN, rel=1e-3)}
    assert new.metadata["request_path_source"].startswith("served traffic: 80 requests")
    # Without the client records the run cannot be taken apart: the probe's path, as before.
    for seed in (7, 8):
        (d / f"real_{seed}_1.250" / "requests.jsonl").unlink()
    old = refit(base, d)
    assert old.request_path != new.request_path
    assert old.metadata["request_path_source"].startswith("cadence serve at idle")
