"""Tool calls in chat responses: the same text gives the same calls streamed (reassembled by the
openai client's own stream accumulator) and not streamed, in OpenAI's shapes."""

from __future__ import annotations

import json

from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from cadence.engine.output_processor import StreamDelta
from cadence.server.formats import ChatFormatter
from cadence.server.protocol import ChatCompletionChunk as ChunkShape
from cadence.server.protocol import ChatCompletionResponse
from cadence.server.tool_parser import ArrayExtractor, HermesExtractor, NamedExtractor

TEXT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')


class Strings:
    def __call__(self, token_id: int) -> str:
        return str(token_id)


def formatter(extractor) -> ChatFormatter:
    return ChatFormatter("chatcmpl-1", "m", 0, 1, Strings(), False, extractor=extractor)


def deltas(text: str, size: int, finish: str = "stop") -> list[StreamDelta]:
    parts = [text[i: i + size] for i in range(0, len(text), size)]
    return [StreamDelta("r", text=p, token_ids=[1], finish_reason=finish if i == len(parts) - 1 else None)
            for i, p in enumerate(parts)]


def streamed(extractor, text: str, size: int = 3, finish: str = "stop"):
    fmt = formatter(extractor)
    chunks = list(fmt.start_chunks())
    for d in deltas(text, size, finish):
        chunks += fmt.chunks(0, d)
    state = ChatCompletionStreamState()
    for c in chunks:
        ChunkShape.model_validate(c)
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    return chunks, state.get_final_completion()


def whole(extractor, text: str, finish: str = "stop") -> dict:
    fmt = formatter(extractor)
    for d in deltas(text, len(text), finish):
        fmt.accumulate(0, d)
    body = fmt.response({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    ChatCompletionResponse.model_validate(body)
    return body["choices"][0]


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_calls_stream_and_answer_alike():
    make = lambda: HermesExtractor(("get_weather", "add"))  # noqa: E731
    chunks, final = streamed(make, TEXT)
    choice = final.choices[0]
    want = [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert calls_of(choice.message) == want
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    # OpenAI's shape: a call's first delta has index, id, type and name; the arguments follow.
    firsts = [c["choices"][0]["delta"] for c in chunks if "id" in c["choices"][0]["delta"].get("tool_calls", [{}])[0]]
    assert [[(tc["index"], tc["type"], tc["function"]["name"], tc["function"]["arguments"]) for tc in d["tool_calls"]]
            for d in firsts] == [[(0, "function", "get_weather", "")], [(1, "function", "add", "")]]
    assert all(set(d) == {"tool_calls"} for d in firsts)  # an opening chunk carries the opening alone
    body = whole(make, TEXT)
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in body["message"]["tool_calls"]] == want


def test_auto_without_calls_is_plain_content_and_a_plain_finish():
    text = "No tools needed <tool_call>broken</tool_call> here."
    _, final = streamed(lambda: HermesExtractor(("add",)), text)
    assert final.choices[0].message.content == text and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "stop"
    body = whole(lambda: HermesExtractor(("add",)), text)
    assert body["message"] == {"role": "assistant", "content": text} and body["finish_reason"] == "stop"


def test_named_function_arguments_stream_in_fragments():
    args = '{"city": "Oslo", "unit": "c"}'
    chunks, final = streamed(lambda: NamedExtractor("get_weather"), args, size=4)
    assert calls_of(final.choices[0].message) == [("get_weather", {"city": "Oslo", "unit": "c"})]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    # OpenAI's shape: the opening alone (empty arguments), then the arguments in fragments.
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    fragments = [tc["function"]["arguments"] for tc in calls[1:]]
    assert all(set(tc) == {"index", "function"} for tc in calls[1:])
    assert len(fragments) > 3 and "".join(fragments) == args
    assert whole(lambda: NamedExtractor("get_weather"), args)["message"]["content"] is None


def test_required_array_and_a_cut_off_answer():
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "parameters": {"a": 2}}]'
    _, final = streamed(ArrayExtractor, text)
    assert calls_of(final.choices[0].message) == [("add", {"a": 1}), ("add", {"a": 2})]
    assert final.choices[0].finish_reason == "tool_calls"
    cut = whole(ArrayExtractor, text[:-20], finish="length")
    assert cut["finish_reason"] == "length"
    assert [c["function"]["name"] for c in cut["message"]["tool_calls"]] == ["add"]
    assert cut["message"]["content"] == text[42:-20].strip()  # the unfinished call, as text


def test_a_call_nested_deeper_than_json_can_parse_stays_text():
    # A model (or a guided_regex beside tool_choice auto) can write JSON nested deeper than
    # Python's parser recurses: the block is malformed as a call, kept as text, never an error.
    deep = "[" * 5000 + "]" * 5000
    hermes = f'<tool_call>{{"name": "add", "arguments": {{"a": {deep}}}}}</tool_call>'
    for ask in (lambda: whole(lambda: HermesExtractor(("add",)), hermes),
                lambda: streamed(lambda: HermesExtractor(("add",)), hermes, size=500)[1].choices[0]):
        answer = ask()
        message = answer["message"] if isinstance(answer, dict) else answer.message.model_dump()
        assert not message.get("tool_calls") and message["content"] == hermes
    array = f'[{{"name": "add", "parameters": {{"a": {deep}}}}}]'
    answer = whole(ArrayExtractor, array)
    assert not answer["message"].get("tool_calls") and deep in answer["message"]["content"]


def test_a_named_call_cut_short_by_a_stop_string_does_not_finish_as_tool_calls():
    # The grammar forces a whole call, but a stop string can end the output inside it: the arguments
    # are not JSON, so the finish reason stays "stop" (as "length" stays for max_tokens).
    cut = '{"city": "Par'
    answer = whole(lambda: NamedExtractor("get_weather"), cut, finish="stop")
    assert answer["finish_reason"] == "stop" and answer["message"]["tool_calls"][0]["function"]["arguments"] == cut
    chunks, _ = streamed(lambda: NamedExtractor("get_weather"), cut, finish="stop")
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]
    done = whole(lambda: NamedExtractor("get_weather"), '{"city": "Paris"}', finish="stop")
    assert done["finish_reason"] == "tool_calls"
    # tool_choice required: the calls completed are returned, the cut one is content, and it stopped.
    array = '[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "parameters": {"a'
    answer = whole(ArrayExtractor, array, finish="stop")
    assert answer["finish_reason"] == "stop" and len(answer["message"]["tool_calls"]) == 1, answer
