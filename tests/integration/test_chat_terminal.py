"""`cadence chat` and `cadence complete` in a real terminal (tmux) against `cadence serve --tiny`:
the reply streams, the whole conversation goes to the server on every turn, Ctrl-C stops a reply
(and the server's request) but not the session, Ctrl-D exits with status 0.

What the server saw is read from its Prometheus counters: with prefix caching off, the prompt
tokens it computed for a turn are exactly the tokens of the conversation it was sent."""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 90.0  # a turn on two shared cores, with the server generating


def _free_port() -> int:
    """A free port in 18000-18999 (0 if none was found there: any free port)."""
    for port in random.sample(range(18000, 19000), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "cadence.cli", "serve", "--tiny", "--port", str(port), "--num-kv-blocks", "512",
           "--max-model-len", "1024", "--device", "cpu", "--dtype", "float32", "--no-enable-prefix-caching"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(lambda: proc.poll() is not None or _healthy(url), "the server to start")
            assert proc.poll() is None, "cadence serve --tiny exited"
            yield url
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _wait(ready: Callable[[], object], what: str, timeout: float = TIMEOUT) -> None:
    """Poll an outside state (a terminal's screen, a server's counters) until it holds."""
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Terminal:
    """One tmux session on a private tmux server, running one command."""

    def __init__(self, socket_name: str, name: str, argv: list[str]) -> None:
        self.base = ["tmux", "-L", socket_name]
        self.name = name
        env = f"PYTHONPATH={shlex.quote(str(ROOT / 'src'))}"
        shell = f"{env} {shlex.join(argv)}; echo \"exited with $?\"; read x"
        subprocess.run([*self.base, "new-session", "-d", "-s", name, "-x", "200", "-y", "50", shell], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", self.name, *keys], check=True)

    def screen(self) -> str:
        out = subprocess.run([*self.base, "capture-pane", "-p", "-J", "-S", "-", "-t", self.name],
                             check=True, capture_output=True, text=True)
        return out.stdout

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen().splitlines() if line.strip()]

    def awaiting_input(self, turns: int) -> bool:
        """The prompt is back after `turns` lines were sent."""
        lines = self.lines()
        return bool(lines) and lines[-1] == ">" and sum(line.startswith(">") for line in lines) == turns + 1


@pytest.fixture
def tmux() -> Iterator[Callable[[str, list[str]], Terminal]]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux; .ci/run installs it)")
    socket_name = f"cadence-test-{uuid.uuid4().hex[:12]}"  # a tmux server of its own, for this test
    try:
        yield lambda name, argv: Terminal(socket_name, name, argv)
    finally:
        subprocess.run(["tmux", "-L", socket_name, "kill-server"], capture_output=True)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _prompt_tokens(url: str) -> float:
    return _metric(url, "cadence:prompt_tokens_total")


def _chat_tokens(url: str, messages: list[dict[str, str]]) -> int:
    r = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30)
    return int(r.json()["count"])


def _squeeze(text: str) -> str:
    return "".join(text.split())


def test_chat_streams_keeps_history_and_exits_on_ctrl_d(server: str, tmux: Callable[..., Terminal]) -> None:
    argv = [sys.executable, "-m", "cadence.cli", "chat", "--url", server + "/v1", "--temperature", "0",
            "--max-tokens", "8"]
    term = tmux("chat", argv)
    _wait(lambda: term.awaiting_input(0), "the chat prompt")
    first, second = {"role": "user", "content": "Hello there"}, {"role": "user", "content": "Tell me more"}

    before = _prompt_tokens(server)
    term.keys(first["content"], "Enter")
    _wait(lambda: term.awaiting_input(1), "the first reply")
    seen_first = _prompt_tokens(server) - before
    before = _prompt_tokens(server)
    term.keys(second["content"], "Enter")
    _wait(lambda: term.awaiting_input(2), "the second reply")
    seen_second = _prompt_tokens(server) - before

    # The first reply, as the server gives it to the same request (greedy, so the same text).
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [first], "temperature": 0, "max_tokens": 8},
                   timeout=60)
    reply = r.json()["choices"][0]["message"]["content"]
    assert reply.strip() and _squeeze(reply) in _squeeze(term.screen())
    assert seen_first == _chat_tokens(server, [first])
    history = [first, {"role": "assistant", "content": reply}, second]
    assert seen_second == _chat_tokens(server, history) > _chat_tokens(server, [second])

    term.keys("C-d")
    _wait(lambda: "exited with 0" in term.screen(), "chat to exit")


def test_complete_ctrl_c_stops_the_reply_and_keeps_the_session(server: str, tmux: Callable[..., Terminal]) -> None:
    argv = [sys.executable, "-m", "cadence.cli", "complete", "--url", server + "/v1", "--max-tokens", "1000"]
    term = tmux("complete", argv)
    _wait(lambda: term.awaiting_input(0), "the complete prompt")
    aborted = _metric(server, 'cadence:finished_requests_total{reason="abort",tenant="default"}')
    term.keys("Once upon a time", "Enter")

    def streaming() -> bool:  # text on the screen while the server is still generating it
        lines = term.lines()
        return len(lines) >= 3 and lines[-2] == "> Once upon a time" and _metric(server, "cadence:running_requests") == 1

    _wait(streaming, "the reply to stream")
    term.keys("C-c")
    _wait(lambda: "[interrupted]" in term.screen() and term.awaiting_input(1), "the interrupted reply")
    _wait(lambda: _metric(server, "cadence:running_requests") == 0, "the server to stop generating")
    assert _metric(server, 'cadence:finished_requests_total{reason="abort",tenant="default"}') == aborted + 1

    term.keys("C-d")
    _wait(lambda: "exited with 0" in term.screen(), "complete to exit")


def test_quick_prints_the_reply_and_server_errors(server: str) -> None:
    def quick(*flags: str, url: str = server + "/v1") -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "cadence.cli", "chat", "--url", url, "--quick", "Hi", *flags]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)

    ok = quick("--temperature", "0", "--max-tokens", "4")
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    refused = quick("--max-tokens", "5000")
    assert refused.returncode == 1
    assert "error: HTTP 400: max_tokens: the prompt has" in refused.stderr and "Traceback" not in refused.stderr
    gone = quick(url=f"http://127.0.0.1:{_free_port()}/v1")
    assert gone.returncode == 1 and "cannot reach the server at" in gone.stderr


def _client(*argv: str, stdin: bytes | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`cadence chat|complete ...` with piped input; its output as bytes."""
    base = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    cmd = [sys.executable, "-m", "cadence.cli", *argv]
    return subprocess.run(cmd, env={**base, "PYTHONPATH": str(ROOT / "src"), **(env or {})}, input=stdin or b"",
                          capture_output=True, timeout=TIMEOUT)


def test_undecodable_input_is_replaced_and_the_session_goes_on(server: str) -> None:
    before = _prompt_tokens(server)
    done = _client("complete", "--url", server + "/v1", "--max-tokens", "2", stdin=b"caf\xe9\nhello \xff\xfe\n")
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert err.count("not all UTF-8") == 1 and "Traceback" not in err
    assert done.stdout.count(b"> ") == 3  # two prompts answered, then end of input
    sent = [httpx.post(server + "/tokenize", json={"prompt": p}, timeout=30).json()["count"]
            for p in ("caf\ufffd", "hello \ufffd\ufffd")]
    assert _prompt_tokens(server) - before == sum(sent)


def test_api_key_from_the_environment(server_factory) -> None:
    keyed = server_factory(api_keys=("sk-env",)).url + "/v1"
    quick = ("chat", "--url", keyed, "--quick", "Hi", "--max-tokens", "2")
    assert _client(*quick, env={"OPENAI_API_KEY": "sk-env"}).returncode == 0
    refused = _client(*quick)
    assert refused.returncode == 1 and b"HTTP 401" in refused.stderr
    # --api-key wins over the environment, as in vllm chat.
    assert _client(*quick, "--api-key", "sk-bad", env={"OPENAI_API_KEY": "sk-env"}).returncode == 1


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_temperature_must_be_a_finite_number(value: str) -> None:
    done = _client("complete", "--url", "http://127.0.0.1:9/v1", "--temperature", value, "--quick", "x")
    assert done.returncode == 2
    assert b"argument --temperature: must be a finite number >= 0" in done.stderr
