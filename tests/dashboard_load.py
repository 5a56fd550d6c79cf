"""Load on a live test server for the dashboard's tests: clients that stream completions in a loop
(each followed by one refused request) until stopped."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import httpx


class StreamingLoad:
    def __init__(self, url: str, model: str, keys: Sequence[str | None], *, max_tokens: int = 200) -> None:
        """One client per entry of `keys` (None: no key)."""
        self.url, self.model, self.keys, self.max_tokens = url, model, list(keys), max_tokens
        self._stop = threading.Event()
        self._done = threading.Condition()
        self.finished = 0  # streams read to their end
        self.refused = 0
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in self.keys]

    def __enter__(self) -> StreamingLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def wait_finished(self, n: int, timeout: float = 60.0) -> bool:
        """Wait until `n` streams have ended (all clients together)."""
        with self._done:
            return self._done.wait_for(lambda: self.finished >= n or bool(self.errors), timeout)

    def _client(self, key: str | None) -> None:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        body = {"model": self.model, "prompt": "the quick brown fox " * 8, "max_tokens": self.max_tokens,
                "stream": True, "ignore_eos": True}
        try:
            with httpx.Client(base_url=self.url, headers=headers, timeout=120) as c:
                while not self._stop.is_set():
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            raise RuntimeError(f"stream answered {r.status_code}: {r.read()[:200]!r}")
                        for _ in r.iter_lines():
                            pass
                    bad = c.post("/v1/completions", json={"model": self.model, "prompt": "x", "max_tokens": 10**9})
                    with self._done:
                        self.finished += 1
                        self.refused += bad.status_code == 400
                        self._done.notify_all()
        except Exception as e:  # noqa: BLE001 - reported to the test through `errors`
            with self._done:
                self.errors.append(f"{type(e).__name__}: {e}")
                self._done.notify_all()
