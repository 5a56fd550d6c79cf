"""stream_options.include_queue_status: a stream that opens with an SSE comment giving the request's
place in the queue and its predicted time to first token, which the openai client skips."""

from __future__ import annotations

import re
import threading

import httpx
import openai

NO_EOS_GREEDY = {"ignore_eos": True, "temperature": 0.0}
COMMENT = re.compile(r"^: queued position=(\d+) predicted_ttft_s=([0-9.]+|unknown) state=(\w+)$")


def test_the_openai_client_parses_a_stream_that_opens_with_the_comment(server) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = {"model": server.engine.model_name, "prompt": "Once upon a time", "max_tokens": 8, "stream": True}
    plain = list(oai.completions.create(**kw, extra_body=NO_EOS_GREEDY))
    with_status = list(oai.completions.create(
        **kw, stream_options={"include_queue_status": True, "include_usage": False},  # type: ignore[typeddict-unknown-key]
        extra_body=NO_EOS_GREEDY))
    assert [c.choices[0].text for c in with_status] == [c.choices[0].text for c in plain]
    assert with_status[-1].choices[0].finish_reason == "length"
    chat = list(oai.chat.completions.create(
        model=server.engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_queue_status": True, "include_usage": True},  # type: ignore[typeddict-unknown-key]
        extra_body=NO_EOS_GREEDY))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].usage.completion_tokens == 4
    # What the client was given: the comment first, then the same events as without the option.
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"prompt": "Once upon a time", "max_tokens": 8, "stream": True, **NO_EOS_GREEDY}
        asked = client.post("/v1/completions", json={**body, "stream_options": {"include_queue_status": True}}).text
        assert COMMENT.match(asked.split("\n", 1)[0]), asked[:200]
        plain_text = client.post("/v1/completions", json=body).text
        assert plain_text.startswith("data: ")  # opt-in only
        # An unknown key is ignored, as other stream_options keys are: no comment.
        typo = client.post("/v1/completions", json={**body, "stream_options": {"include_queue_stats": True}})
        assert typo.status_code == 200 and typo.text.startswith("data: ")
        not_a_stream = {**body, "stream": False, "stream_options": {"include_queue_status": True}}
        refused = client.post("/v1/completions", json=not_a_stream)
        assert refused.status_code == 400 and "stream_options" in refused.text


def test_the_stream_starts_with_the_comment_before_the_first_token(server_factory) -> None:
    live = server_factory({"max_num_seqs": 1})
    holder = {"prompt": "hold the seat", "max_tokens": 1000, **NO_EOS_GREEDY, "stream": True}
    asked = {"prompt": "wait", "max_tokens": 3, **NO_EOS_GREEDY, "stream": True,
             "stream_options": {"include_queue_status": True, "include_usage": False}}
    with httpx.Client(base_url=live.url, timeout=60) as client, client.stream("POST", "/v1/completions", json=holder) as h:
        assert h.status_code == 200
        lines: list[str] = []
        got_comment = threading.Event()

        def read() -> None:
            with httpx.stream("POST", f"{live.url}/v1/completions", json=asked, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith(":"):
                        got_comment.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert got_comment.wait(30), lines
        # The holder still has its seat: the waiting request has no token yet, only the comment.
        assert live.core.scheduler.waiting and not any(line.startswith("data:") for line in lines), lines
        m = COMMENT.match(lines[0])
        assert m, lines[0]
        assert m.group(1) == "0" and m.group(3) == "waiting"
        assert m.group(2) != "unknown" and float(m.group(2)) > 0
    reader.join(60)  # leaving the holder's stream aborted it: the waiting one runs to its end
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    assert [line for line in events if line.startswith(":")] == [events[0]]  # one comment, first
