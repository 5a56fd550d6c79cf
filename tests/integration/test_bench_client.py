"""The benchmark client against a small third-party-shaped OpenAI-compatible server.

The fake server streams fake tokens with known sleeps, sends no usage chunks, ignores ignore_eos
and min_tokens (every answer stops after EOS_AT tokens), and answers every REJECT_EVERY-th request
with 429 + Retry-After. /tokenize and /detokenize (one token per character) can be switched off
to make it look like a server without them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cadence.bench.cli import main
from cadence.bench.client import BenchConfig, run_benchmark
from cadence.workload import Scaling, builtin_workload, scale_workload

TTFT_S = 0.05
ITL_S = 0.01
EOS_AT = 6
REJECT_EVERY = 4


@dataclass
class FakeState:
    tokenize: bool = False
    count: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)
    tenants: list[str | None] = field(default_factory=list)
    rejected: int = 0


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        if not state.tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        text = (await req.json())["prompt"]
        return {"tokens": [ord(c) for c in text], "count": len(text)}

    @app.post("/detokenize")
    async def detokenize(req: Request):
        if not state.tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"prompt": "".join(chr(t) for t in (await req.json())["tokens"])}

    async def generate(req: Request, chat: bool):
        body = await req.json()
        state.count += 1
        state.bodies.append(body)
        state.tenants.append(req.headers.get("x-tenant"))
        if state.count % REJECT_EVERY == 0:
            state.rejected += 1
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit", "param": None, "code": 429}},
                                status_code=429, headers={"Retry-After": "1"})
        n = min(body.get("max_tokens", 16), EOS_AT)  # ignores ignore_eos and min_tokens

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                await asyncio.sleep(TTFT_S)
                for k in range(n):
                    if k:
                        await asyncio.sleep(ITL_S)
                    piece = f"w{k} "
                    choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                    choice["finish_reason"] = "stop" if k == n - 1 else None
                    yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await generate(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await generate(req, chat=True)

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_server():
    state = FakeState()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


def _workload(n: int):
    # Outputs clamped to 12 tokens: most requests ask for more than the server's EOS_AT.
    return scale_workload(builtin_workload("mixed-tenants", n, seed=3), Scaling(max_output_tokens=12, max_prompt_tokens=64))


def test_open_loop_counts_429s_short_outputs_and_writes_files(fake_server, tmp_path: Path) -> None:
    url, state = fake_server
    w = _workload(16)
    cfg = BenchConfig(base_url=url, workload=w, arrival="poisson", rate=40.0, seed=1, slos={"ttft": 2.0},
                      out_dir=str(tmp_path), progress=False)
    res = run_benchmark(cfg)
    o = res.summary["overall"]
    assert o["requests"] == 16 == state.count
    assert o["rate_limited"] == state.rejected == 16 // REJECT_EVERY
    assert o["errors"] == state.rejected and o["completed"] == 16 - state.rejected
    limited = [r for r in res.records if r.status == 429]
    assert all(r.retry_after == 1.0 for r in limited)
    ok = [r for r in res.records if r.ok]
    assert all(r.output_tokens == min(r.output_tokens_asked, EOS_AT) for r in ok)
    assert all(r.output_count_source == "chunks" for r in ok)
    assert o["short_outputs"] == sum(1 for r in ok if r.output_tokens_asked > EOS_AT) > 0
    warnings = " ".join(res.summary["warnings"])
    assert "ignore_eos" in warnings and "chunks" in warnings and "429" in warnings
    assert any("estimate" in n for n in res.summary["meta"]["notes"])  # no /tokenize: says so
    # Latencies against the server's known sleeps (generous upper bounds: shared CI cores).
    assert TTFT_S <= o["ttft"]["p50"] < TTFT_S + 1.0
    assert 0.5 * ITL_S <= o["itl"]["p50"] < ITL_S + 0.2
    assert o["e2e"]["max"] >= TTFT_S + (EOS_AT - 1) * ITL_S * 0.9
    # What was sent: exact-length fields, tenants in the header and `user`, priorities.
    assert all(b["ignore_eos"] is True and b["min_tokens"] == b["max_tokens"] for b in state.bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in state.bodies)
    tenants = sorted({r.tenant for r in w.requests[:16]})
    assert sorted(set(state.tenants)) == tenants
    assert {b["user"] for b in state.bodies} == set(tenants)
    assert set(res.summary["per_tenant"]) == set(tenants)
    assert res.summary["fairness"]["tenants"]["jain_output_throughput"] is not None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["overall"]["rate_limited"] == o["rate_limited"]
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 16
    assert (tmp_path / "latency_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closed_loop_chat_with_server_tokenizer(fake_server) -> None:
    url, state = fake_server
    state.tokenize = True
    w = _workload(9)
    cfg = BenchConfig(base_url=url, endpoint="chat", workload=w, arrival="none", concurrency=3, progress=False,
                      temperature=0.7, top_p=0.9)
    res = run_benchmark(cfg)
    assert state.count == 9 and len(res.records) == 9
    assert all(b["temperature"] == 0.7 and b["top_p"] == 0.9 for b in state.bodies)
    with pytest.raises(ValueError, match="top_p"):
        BenchConfig(base_url=url, workload=w, arrival="none", concurrency=1, top_p=1.5).validate()
    assert state.max_in_flight <= 3
    # One token per character here, so exact prompt sizes mean exact character counts.
    contents = [b["messages"][0]["content"] for b in state.bodies]
    assert sorted(len(c) for c in contents) == sorted(r.prompt_tokens for r in w.requests)
    ok = [r for r in res.records if r.ok]
    assert ok and all(r.output_count_source == "tokenize" for r in ok)
    assert all(r.output_tokens == len(r.text) for r in ok)
    assert any("exact token counts" in n for n in res.summary["meta"]["notes"])


def test_duration_bounds_the_open_loop(fake_server) -> None:
    url, state = fake_server
    cfg = BenchConfig(base_url=url, workload=_workload(100), arrival="poisson", rate=40.0, duration=0.4,
                      progress=False)
    res = run_benchmark(cfg)
    assert 0 < len(res.records) < 100
    assert all(r.scheduled_time <= 0.4 and r.send_time <= 0.4 + 0.3 for r in res.records)
    assert state.count == len(res.records)
    # The duration ended the sends, not the workload (was: "all N prepared requests were sent before
    # the duration ended", on every open-loop run, since the workload is cut at the duration first).
    assert not any("sent before" in n or "ran out" in n for n in res.summary["meta"]["notes"])
    short = run_benchmark(BenchConfig(base_url=url, workload=_workload(3), arrival="poisson", rate=40.0,
                                      duration=5.0, progress=False))
    assert len(short.records) == 3
    assert any("all 3 requests of the workload arrive before the 5s duration ends" in n
               for n in short.summary["meta"]["notes"])


def test_duration_bounds_the_closed_loop(fake_server) -> None:
    url, state = fake_server
    cfg = BenchConfig(base_url=url, workload=_workload(1000), arrival="none", concurrency=2, duration=0.3,
                      progress=False)
    res = run_benchmark(cfg)
    # Each request takes ~0.1 s: two users send a handful, then stop at 0.3 s.
    assert 2 <= len(res.records) <= 40 and state.count == len(res.records)
    assert max(r.send_time for r in res.records) <= 0.3 + 0.3
    assert all(r.error is None or r.status == 429 for r in res.records)


def test_cli_run_compare_and_sweep(fake_server, tmp_path: Path, capsys) -> None:
    url, _ = fake_server
    common = ["--base-url", url, "--num-requests", "6", "--max-output-tokens", "4", "--max-prompt-tokens", "32",
              "--no-progress", "--slo", "ttft=2"]
    assert main([*common, "--rate", "30", "--out", str(tmp_path / "a"), "--label", "a"]) == 0
    assert main([*common, "--concurrency", "2", "--out", str(tmp_path / "b"), "--label", "b"]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b" / "summary.json"), "--out", str(tmp_path / "ab")]) == 0
    out = capsys.readouterr().out
    assert "request_throughput" in out and "B/A" in out and "ttft.p95" in out
    assert (tmp_path / "ab" / "latency_cdf_compare.png").read_bytes()[:4] == b"\x89PNG"  # both runs' CDFs
    assert main(["sweep", *common, "--rates", "20,40", "--out", str(tmp_path / "s")]) == 0
    sweep = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [p["load"] for p in sweep["points"]] == [20.0, 40.0]
    assert (tmp_path / "s" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    # Two sweeps: a table per shared load point and one plot of both.
    assert main(["sweep", *common, "--rates", "40,60", "--out", str(tmp_path / "s2")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "s"), str(tmp_path / "s2" / "sweep.json"), "--out", str(tmp_path / "c")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows if r and r[0].replace(".", "").isdigit()] == ["40"]  # the only common load
    assert (tmp_path / "c" / "sweep_compare.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", str(tmp_path / "s"), str(tmp_path / "a")]) == 2  # a sweep and a run: clear error
    assert "not one of each" in capsys.readouterr().err
    assert main(["--base-url", url, "--num-requests", "3", "--no-progress"]) == 0  # no load: all at once, as vLLM
    assert "note: request rate inf: all 3 requests arrive at time 0" in capsys.readouterr().out
    nobody = f"http://127.0.0.1:{_free_port()}"
    assert main(["--base-url", nobody, "--rate", "1", "--num-requests", "2", "--no-progress"]) == 2
    assert "ConnectError" in capsys.readouterr().err


@pytest.mark.parametrize(("answer", "says"), [
    (None, "no answer within 1 s"),  # accepts, never answers: was a wait of --request-timeout
    (b"hello", "the answer is not JSON"),  # was "Expecting value: line 1 column 1 (char 0)"
    (b'{"data": [{"name": "x"}]}', "the first model has no 'id'"),  # was a KeyError traceback
    (b'{"data": []}', "lists no models"),
])
def test_cli_a_server_that_is_not_openai_shaped_is_a_quick_clear_error(answer: bytes | None, says: str, capsys) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    conns: list[socket.socket] = []

    def serve() -> None:
        conn, _ = listener.accept()
        conns.append(conn)
        conn.recv(65536)
        if answer is not None:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(answer), answer))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    t0 = time.monotonic()
    try:
        rc = main(["--base-url", url, "--rate", "1", "--num-requests", "2", "--no-progress", "--request-timeout", "1"])
    finally:
        thread.join(5)
        for c in conns:
            c.close()
        listener.close()
    assert rc == 2 and time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_requests_held_back_by_the_concurrency_cap_and_never_sent_are_noted(fake_server) -> None:
    """Open loop with a cap: requests still waiting for a slot when the drain ends were never sent;
    the report leaves them out and says how many (was: silently dropped)."""
    url, state = fake_server
    cfg = BenchConfig(base_url=url, workload=_workload(6), arrival="poisson", rate=1000.0, concurrency=1,
                      drain_timeout=0.02, progress=False)
    res = run_benchmark(cfg)
    assert len(res.records) == 1 and state.count <= 1  # one in its slot (then cancelled), five held back
    assert res.records[0].error.startswith("cancelled") and res.summary["overall"]["errors"] == 1
    assert any("5 of 6 requests never sent" in n for n in res.summary["meta"]["notes"])


def test_vllm_bench_serve_spellings(fake_server, tmp_path: Path, capsys) -> None:
    """`vllm bench serve`'s flags where they mean the same: --host/--port, --num-prompts,
    --request-rate inf with --max-concurrency, the random dataset, --goodput in ms, the percentile
    table, --save-result with --result-dir and --result-filename."""
    url, state = fake_server
    port = url.rsplit(":", 1)[1]
    argv = ["--host", "127.0.0.1", "--port", port, "--dataset-name", "random", "--random-input-len", "20",
            "--random-output-len", "4", "--random-range-ratio", "0.5", "--num-prompts", "8", "--request-rate", "inf",
            "--max-concurrency", "3", "--ignore-eos", "--goodput", "ttft:2000", "e2el:5000",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(tmp_path / "r"), "--result-filename", "vllm.json", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert state.count == 8 and state.max_in_flight <= 3  # every prompt sent, at most 3 at a time
    assert all(b.get("ignore_eos") is True for b in state.bodies)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["slos"] == {"ttft": 2.0, "e2e": 5.0}
    assert json.loads((tmp_path / "r" / "vllm.json").read_text()) == summary
    table = [line.split() for line in out.splitlines() if line.startswith(("metric (ms)", "ttft ", "e2el "))]
    assert table[-3][-2:] == ["p50", "p99"] and [r[0] for r in table[-2:]] == ["ttft", "e2el"]  # as asked
    prompts = [len(b["prompt"]) for b in state.bodies]
    assert len(set(prompts)) > 1  # lengths vary with the range ratio


@pytest.mark.parametrize(("argv", "says"), [
    (["--host", "h", "--base-url", "http://x"], "either them or --base-url"),
    (["--ignore-eos", "--no-exact-output", "--rate", "1"], "contradict"),
    (["--dataset-name", "random", "--workload", "chat", "--rate", "1"], "not both"),
    (["--goodput", "ttft=500", "--rate", "1"], "KEY:MILLISECONDS"),
    (["--result-dir", "x", "--rate", "1"], "go with --save-result"),
    (["--percentile-metrics", "bogus", "--rate", "1"], "--percentile-metrics"),
    (["--port", "18500", "bogus"], "unknown action 'bogus'"),
])
def test_vllm_spellings_refuse_contradictions(argv: list[str], says: str, capsys) -> None:
    assert main([*argv, "--num-requests", "1", "--no-progress"]) == 2
    assert says in capsys.readouterr().err


def test_cli_run_warns_on_a_busy_machine(fake_server, tmp_path: Path, capsys, monkeypatch) -> None:
    url, _ = fake_server
    argv = ["--base-url", url, "--num-requests", "2", "--max-output-tokens", "4", "--max-prompt-tokens", "32",
            "--no-progress", "--rate", "30"]
    monkeypatch.setattr("cadence.host_load.os.cpu_count", lambda: 2)
    for load, warned in ((0.2, False), (7.5, True)):
        monkeypatch.setattr("cadence.host_load.os.getloadavg", lambda load=load: (load, load, load))
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert ("warning: the machine is busy (load average 7.5 on 2 CPUs)" in out) == warned, out
