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


class SpecReader(HTMLParser):
    """The speculative-decoding section's attributes and its note's text."""

    def __init__(self) -> None:
        super().__init__()
        self.section: dict[str, str | None] | None = None
        self.note = ""
        self._in_note = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id") == "spec-section":
            self.section = found
        self._in_note = found.get("id") == "spec-note"

    def handle_data(self, data: str) -> None:
        if self._in_note:
            self.note += data

    def handle_endtag(self, tag: str) -> None:
        self._in_note = False


def read_spec(tmp_path: Path, url: str) -> SpecReader:
    reader = SpecReader()
    reader.feed(chromium(tmp_path, url, "--dump-dom").stdout)
    assert reader.section is not None, "no speculative-decoding section in the page"
    return reader


def test_a_speculating_server_shows_its_acceptance_rate(server_factory, tmp_path):
    import httpx

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    srv = server_factory({"speculative_config": spec})
    body = {"prompt": "apple banana cherry apple banana cherry apple banana", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    data = httpx.get(srv.url + "/dashboard/data", timeout=30).json()["speculative"]
    assert data is not None and data["draft_tokens"] > 0, data
    reader = read_spec(tmp_path, f"{srv.url}/dashboard")
    assert "hidden" not in reader.section, reader.section
    rate = f"acceptance {100 * data['acceptance_rate']:.1f}% ({data['accepted_tokens']} of {data['draft_tokens']}"
    assert reader.note.startswith(rate), reader.note
    assert "draft tokens/s" in reader.note and "accepted/s" in reader.note


def test_a_server_that_does_not_speculate_shows_no_speculation(live, tmp_path):
    reader = read_spec(tmp_path, f"{live.url}/dashboard#key=k-admin")
    assert "hidden" in reader.section and reader.note == "", (reader.section, reader.note)
