"""The dashboard in a real browser: Debian's Chromium, headless, against a live server under load.

The page is loaded twice (the same window size, so the same layout): once to read the DOM it has
built (its status element: updates made, script errors, each chart's place on the page), once for
a screenshot, decoded to check that every chart holds data ink (the charts draw data in saturated
colours; frames, text and limit lines are grey).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from dashboard_load import StreamingLoad

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium); .ci/run installs it"
)

WINDOW = (1300, 1200)
CHARTS = ("chart-queue", "chart-tokens", "chart-rows", "chart-kv", "chart-latency", "chart-service", "chart-events")
MIN_INK_PIXELS = 1000  # with data a chart has thousands; empty, grey text and the KV legend swatches (~300)


class StatusReader(HTMLParser):
    """The attributes of the page's status element."""

    def __init__(self) -> None:
        super().__init__()
        self.status: dict[str, str | None] | None = None
        self.keyform: dict[str, str | None] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id") == "status":
            self.status = found
        elif found.get("id") == "keyform":
            self.keyform = found


def chromium(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
        f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--force-device-scale-factor=1", "--hide-scrollbars", "--enable-logging=stderr",
        "--virtual-time-budget=4000", *args, url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def read_page(tmp_path: Path, url: str) -> tuple[StatusReader, str]:
    done = chromium(tmp_path, url, "--dump-dom")
    reader = StatusReader()
    reader.feed(done.stdout)
    assert reader.status is not None, f"no status element in the page: {done.stdout[:500]!r}"
    return reader, done.stderr


def ink(image: Image.Image, box: list[int]) -> int:
    """Pixels of saturated colour (data) inside `box` = [left, top, width, height]."""
    x, y, w, h = box
    raw = image.crop((x, y, x + w, y + h)).convert("RGB").tobytes()
    return sum(1 for i in range(0, len(raw), 3) if max(raw[i:i + 3]) - min(raw[i:i + 3]) > 80)


@pytest.fixture(scope="module")
def live(server_factory):
    return server_factory(
        {"max_num_seqs": 2, "max_num_batched_tokens": 256},
        api_keys=("k-admin", "k-acme", "k-globex"),
        api_key_tenants=(("k-acme", "acme"), ("k-globex", "globex")),
    )


def test_the_charts_draw_the_running_server(live, tmp_path):
    keys = ["k-acme"] * 4 + ["k-globex"] * 4
    with StreamingLoad(live.url, live.engine.model_name, keys) as load:
        assert load.wait_finished(len(keys)), load.errors  # every client has streamed (and been refused) once
        url = f"{live.url}/dashboard#key=k-admin"
        reader, stderr = read_page(tmp_path, url)
        status = reader.status
        assert status is not None
        assert status["data-state"] == "ok", status
        assert status["data-errors"] == "0" and status["data-failures"] == "0", status
        assert int(status["data-polls"] or 0) >= 2, status
        assert "Uncaught" not in stderr, stderr[-2000:]
        layout = json.loads(status["data-layout"] or "{}")
        assert set(CHARTS) <= set(layout), layout
        shot = tmp_path / "dashboard.png"
        chromium(tmp_path, url, f"--screenshot={shot}")
    assert not load.errors, load.errors
    image = Image.open(shot)
    assert image.size == WINDOW
    counts = {chart: ink(image, layout[chart]) for chart in CHARTS}
    empty = {chart: n for chart, n in counts.items() if n < MIN_INK_PIXELS}
    assert not empty, f"charts without data: {empty} (all: {counts})"
    print("data pixels per chart:", counts)


def test_without_a_key_the_page_asks_for_one(live, tmp_path):
    reader, _ = read_page(tmp_path, f"{live.url}/dashboard")
    assert reader.status is not None and reader.status["data-state"] == "unauthorized", reader.status
    assert reader.keyform is not None and "shown" in (reader.keyform.get("class") or "")
