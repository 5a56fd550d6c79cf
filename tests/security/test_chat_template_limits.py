"""Hostile chat templates and large chats: a template's work is bounded (time, output, loop
iterations and calls) and no chat blocks the server's event loop.

- from a request (`chat_template` with --allow-request-chat-template): 400 naming the limit;
- the model's own: `cadence serve` refuses to start, naming the template; a conversation that only
  a longer chat sets off is a 500 naming the model's template, not a 400 blaming `messages`;
- rendering and tokenizing run off the event loop: /health answers while a 1 MB chat is tokenized.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.model.loader import LoadError
from cadence.model.template_limits import ChatTemplateLimitError, RenderLimits
from cadence.model.tokenizer import Tokenizer
from cadence.server.app import create_app

CHAT = [{"role": "user", "content": "hi"}]
# 10**10 iterations with no output: without a budget, hours of one thread's CPU.
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# 2**40 macro calls, never deeper than 40: recursion without a recursion error.
EXPONENTIAL_MACRO = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
HUGE_OUTPUT = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
SMALL = RenderLimits(timeout=30.0, max_chars=100_000, max_iterations=200_000)  # the time limit never bites


@pytest.fixture(scope="module")
def base() -> Tokenizer:
    return Tokenizer.from_model_path(None)


def with_template(base: Tokenizer, template: str | None, limits: RenderLimits = SMALL) -> Tokenizer:
    return Tokenizer(base._tok, name="probe-model", bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                     chat_template=template, template_limits=limits)


# -- the render budget, limit by limit --------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "option"),
    [
        (NESTED_LOOPS, "chat_template_max_iterations"),
        (EXPONENTIAL_MACRO, "chat_template_max_iterations"),
        ("{% for x in [1] recursive %}{{ loop([x]) }}{% endfor %}", None),  # endless recursive loop
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", None),  # endless recursion
        (HUGE_OUTPUT, "chat_template_max_chars"),
        ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
         "chat_template_max_chars"),
        ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
         "chat_template_max_chars"),
        ("{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
         "chat_template_max_chars"),
        ("{{ ('x' * 1000) | replace('', 'y' * 1000) }}", "chat_template_max_chars"),
        ("{{ ('x' * 1000).replace('', 'y' * 1000) }}", "chat_template_max_chars"),
        ("{{ ('x\n' * 1000) | indent(1000) }}", "chat_template_max_chars"),
        ("{{ 'x' | center(999999999) }}", "chat_template_max_chars"),
        ("{{ 'x'.ljust(999999999) }}", "chat_template_max_chars"),
        ("{{ ('\t' * 1000).expandtabs(100000) }}", "chat_template_max_chars"),
        ("{{ (['x' * 50000] * 3) | join }}", "chat_template_max_chars"),
        ("{{ ''.join(['x' * 50000] * 3) }}", "chat_template_max_chars"),
        ("{{ 'x' * 200000 }}", "chat_template_max_chars"),
        ("{{ [1] | batch(999999999, 0) | list }}", "chat_template_max_chars"),
    ],
)
def test_a_template_over_a_limit_is_stopped(base: Tokenizer, template: str, option: str | None) -> None:
    tok = with_template(base, None)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateLimitError) as info:
        tok.apply_chat_template(CHAT, chat_template=template)
    assert info.value.option == option
    assert time.monotonic() - t0 < 20


def test_the_time_limit_stops_a_template_within_iteration_limits(base: Tokenizer) -> None:
    tok = with_template(base, None, RenderLimits(timeout=0.3, max_iterations=10**12))
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateLimitError, match=r"ran longer than 0\.3 s") as info:
        tok.apply_chat_template(CHAT, chat_template=EXPONENTIAL_MACRO)
    assert info.value.option == "chat_template_timeout"
    assert time.monotonic() - t0 < 3


def test_metered_templates_render_as_jinja_does(base: Tokenizer) -> None:
    """Loops through the meter keep their loop variables; recursive loops, concatenation and
    constant-folded filters give what jinja2's own sandbox gives."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% if loop.last %}!{% endif %} "
                "{% endfor %}{% for x in [[1, [2]], [3]] recursive %}<{{ loop(x) if x is iterable else x }}>"
                "{% endfor %}{{ 'ab' | center(6) }}{{ ['a', 'b'] | join('-') }}{{ 'a' ~ 'b' }}{{ [1] + [2] }}")
    messages = [*CHAT, {"role": "assistant", "content": "yo"}]
    text = with_template(base, None).render_chat(messages, chat_template=template).text
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    assert text == plain.render(messages=messages) and text.startswith("1/2 2/2! <")


def test_the_model_template_over_a_limit_fails_at_load(base: Tokenizer) -> None:
    with pytest.raises(LoadError, match=r"probe-model: the model's chat template made more than 200000 loop "
                                        r"iterations and calls on a 2-message probe conversation"):
        with_template(base, NESTED_LOOPS)


def test_a_model_template_that_only_fails_otherwise_still_loads(base: Tokenizer, caplog) -> None:
    tok = with_template(base, "{{ raise_exception('only system prompts') }}")
    assert tok.chat_template is not None and "only system prompts" in caplog.text


def test_serve_refuses_to_start_with_a_looping_model_template(base: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(base._tok.to_str())
    config = {"chat_template": NESTED_LOOPS, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cadence.cli", "serve", str(tmp_path), "--tiny", "--port", "0",
         "--chat-template-timeout", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the model's chat template" in proc.stderr and "--chat-template-" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 90


# -- through the server -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    def __init__(self, **engine_options: Any) -> None:
        options = {"num_kv_blocks": 512, "max_model_len": 1024, "device": "cpu", "dtype": "float32",
                   **engine_options}
        self.engine = AsyncEngine(build_engine(EngineConfig.from_options(**options), tiny=True))
        config = ServerConfig(port=_free_port(), allow_request_chat_template=True, max_body_bytes=4 << 20)
        app = create_app(self.engine, config)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{config.port}"
        end = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.engine.shutdown(timeout=10)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    server = Live(chat_template_timeout=1.0, chat_template_max_iterations=10**12)
    try:
        yield server
    finally:
        server.stop()


def chat(live: Live, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + "/v1/chat/completions", json={"max_tokens": 2, **body}, timeout=60)


@pytest.mark.parametrize("template", [NESTED_LOOPS, EXPONENTIAL_MACRO, HUGE_OUTPUT])
def test_a_request_template_over_a_limit_is_a_400_naming_the_limit(live: Live, template: str) -> None:
    t0 = time.monotonic()
    r = chat(live, {"messages": CHAT, "chat_template": template})
    assert time.monotonic() - t0 < 15
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and err["type"] == "invalid_request_error"
    assert "over this server's limit (the limit: option chat_template_" in err["message"], err
    assert chat(live, {"messages": CHAT}).status_code == 200  # the server goes on


# One built-in call that counts nothing while it works: a request template's render runs in a
# worker process, which is killed past the time limit and whose memory is capped.
UNCOUNTED = {
    "wordwrap": ("{{ ('a ' * 1900000)|wordwrap(1) }}", "ran longer than 1 s"),
    "width from an argument": ("{{ '%*s' % (3000000000, 'a') }}", "MiB of memory"),
    "format width": ("{{ '{:{}}'.format('a', 3000000000) }}", "MiB of memory"),
}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("name", list(UNCOUNTED))
def test_an_uncounted_builtin_is_stopped_in_its_worker(live: Live, name: str) -> None:
    template, says = UNCOUNTED[name]
    before = _rss_mib()
    t0 = time.monotonic()
    r = chat(live, {"messages": CHAT, "chat_template": template})
    assert time.monotonic() - t0 < 15
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert says in r.json()["error"]["message"]
    assert _rss_mib() - before < 100  # the server's own memory: the work was the worker's
    assert chat(live, {"messages": CHAT, "chat_template": "{{ messages[0].content }}"}).status_code == 200


def test_lipsum_is_not_offered(live: Live) -> None:
    r = chat(live, {"messages": CHAT, "chat_template": "{{ lipsum(n=100000000)|length }}"})
    assert r.status_code == 400 and "'lipsum' is undefined" in r.json()["error"]["message"]


def test_runaway_request_templates_never_block_the_chat_route(live: Live) -> None:
    """More runaway renders than there are workers, clients giving up: the next chats still answer."""
    template = UNCOUNTED["wordwrap"][0]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(chat, live, {"messages": CHAT, "chat_template": template}) for _ in range(6)]:
            assert f.result().status_code == 400
    assert chat(live, {"messages": CHAT}).status_code == 200
    assert chat(live, {"messages": CHAT, "chat_template": "{{ messages[0].content }}"}).status_code == 200


def test_the_model_template_over_a_limit_is_a_500_naming_it(live: Live) -> None:
    """A model template that passes the load-time probes but loops on longer conversations."""
    tokenizer = live.engine.tokenizer
    model_template = tokenizer.chat_template
    tokenizer.chat_template = "{% if messages | length > 2 %}" + NESTED_LOOPS + "{% endif %}" + model_template
    try:
        long_chat = [*CHAT, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
        r = chat(live, {"messages": long_chat})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["param"] is None
        assert err["message"].startswith("the model's chat template ran longer than 1 s on this conversation")
        assert "flag --chat-template-timeout" in err["message"]
        assert chat(live, {"messages": CHAT}).status_code == 200
    finally:
        tokenizer.chat_template = model_template


# Polls /health from another process (a thread of this one would stall with the GIL as the server's
# loop does, and see nothing): one line per answer, "sent-at latency", until stdin closes.
_PROBE = """
import sys, threading, time, httpx
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(timeout=30) as c:
    print("ready", flush=True)
    while not done.is_set():
        t0 = time.time()
        assert c.get(sys.argv[1] + "/health").status_code == 200
        print(t0, time.time() - t0, flush=True)
        time.sleep(0.005)
"""


def health_latencies_during(live: Live, route: str, body: dict[str, Any]) -> tuple[httpx.Response, float, list[float]]:
    """Send one request while another process polls /health: (response, seconds it took, the
    latencies of the health checks sent while it ran)."""
    probe = subprocess.Popen([sys.executable, "-c", _PROBE, live.url], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout is not None and probe.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        t0 = time.time()
        r = httpx.post(live.url + route, json={"max_tokens": 2, **body}, timeout=60)
        t1 = time.time()
        out, _ = probe.communicate("", timeout=60)
    finally:
        probe.kill()
    samples = [tuple(map(float, line.split())) for line in out.splitlines()]
    return r, t1 - t0, [lat for sent, lat in samples if t0 <= sent + lat and sent <= t1]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_the_event_loop_answers_while_a_megabyte_is_tokenized(live: Live, route: str, monkeypatch) -> None:
    # A megabyte is refused by its length alone, untokenized, at this context (see below); with the
    # bound lifted, the tokenization itself must not hold the event loop.
    monkeypatch.setattr(live.engine.tokenizer, "max_token_chars", 10**9)
    text = "The quick brown fox jumps over the lazy dog. " * 23_000  # ~1 MB: ~250k tokens
    body = {"messages": [{"role": "user", "content": text}]} if route.endswith("chat/completions") else {"prompt": text}
    r, took, during = health_latencies_during(live, route, body)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]  # tokenized, then refused
    assert took > 0.2, "the request was too quick to tell"
    # The loop answered all along: many health checks, none held for a good part of the tokenization.
    assert len(during) >= 5 and max(during) < max(0.1, took / 3), (took, len(during), sorted(during)[-5:])


def test_a_conversation_over_the_character_cap_is_the_clients_400(base: Tokenizer) -> None:
    """Contents alone over --chat-template-max-chars: refused naming messages, before any render
    (it was a 500 blaming the model's template)."""
    tok = with_template(base, base.chat_template, RenderLimits(max_chars=2048))
    with pytest.raises(ValueError, match=r"^messages: the conversation has 3000 characters"):
        tok.render_chat([{"role": "user", "content": "x" * 3000}])


def test_a_template_that_amplifies_a_tiny_body_is_refused_untokenized(live: Live) -> None:
    """A 160-byte request whose template writes 4 M characters: at least that many tokens over the
    context, refused by length before it is tokenized (tokenizing it took seconds and ~600 MiB)."""
    before = _rss_mib()
    t0 = time.monotonic()
    r = chat(live, {"messages": CHAT, "chat_template": "{{ ('a ' * 1999999) }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "characters are at least" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10 and _rss_mib() - before < 100
    big = httpx.post(live.url + "/v1/completions", json={"prompt": "a " * 500_000, "max_tokens": 1}, timeout=60)
    assert big.status_code == 400 and "characters are at least" in big.json()["error"]["message"]


def test_request_templates_waiting_for_a_worker_do_not_hold_up_other_chats(live: Live) -> None:
    """Twelve runaway request templates queue for the two render workers; a plain chat sent meanwhile
    is answered at once (the waiting renders held the threads every chat renders in)."""
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        hostile = [pool.submit(chat, live, {"messages": CHAT, "chat_template": NESTED_LOOPS}) for _ in range(12)]
        time.sleep(0.5)  # the renders are queued
        t0 = time.monotonic()
        assert chat(live, {"messages": CHAT}).status_code == 200
        waited = time.monotonic() - t0
        assert all(f.result().status_code == 400 for f in hostile)
    assert waited < 4.0, f"a plain chat waited {waited:.1f} s behind request templates"
