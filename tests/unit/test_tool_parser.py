"""Tool calls out of generated text: Hermes blocks (tool_choice auto), a named function's arguments,
the forced array (required); fed whole or piece by piece, the same calls and content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.server.tool_parser import (
    ArrayExtractor,
    CallArguments,
    CallStart,
    Content,
    Extractor,
    HermesExtractor,
    NamedExtractor,
    gather,
)

NAMES = ("get_weather", "add")


def run(ext: Extractor, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    out = []
    for p in pieces:
        out += ext.feed(p)
    out += ext.finish()
    got = gather(out)
    for call_id, _, _ in got.calls:
        assert call_id.startswith("call_") and len(call_id) == 29
    return got.content, [(name, json.loads(args)) for _, name, args in got.calls]


def whole_and_by_char(make, text: str) -> tuple[str, list[tuple[str, dict]]]:
    whole = run(make(), [text])
    assert run(make(), list(text)) == whole
    return whole


def hermes(text: str, parallel: bool = True) -> tuple[str, list[tuple[str, dict]]]:
    return whole_and_by_char(lambda: HermesExtractor(NAMES, parallel), text)


def test_hermes_blocks_become_calls_and_the_rest_is_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    content, calls = hermes(text)
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("block", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
    '<tool_call>["get_weather"]</tool_call>',  # not an object
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not an offered tool
    '<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>',  # arguments not an object
])
def test_malformed_blocks_stay_in_the_content_as_written(block: str):
    content, calls = hermes(f"Before {block} after")
    assert calls == []
    assert content == f"Before {block} after"


def test_a_block_never_closed_stays_in_the_content():
    text = 'Sure <tool_call>{"name": "add", "arguments": {"a": 1'
    assert hermes(text) == (text, [])


def test_text_without_blocks_comes_back_exactly():
    text = "  a <b> <tool  x <tool_cal  \n\n end  \n"
    assert hermes(text) == (text, [])


def test_one_call_only_without_parallel_tool_calls():
    one = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    content, calls = hermes(one + one, parallel=False)
    assert calls == [("add", {"a": 1})] and content == one


def test_parameters_is_taken_for_arguments_and_missing_arguments_are_empty():
    text = '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call><tool_call>{"name": "add"}</tool_call>'
    assert hermes(text)[1] == [("add", {"a": 1}), ("add", {})]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab <>/_\n{}\"tolcal", max_size=12), max_size=8), st.data())
def test_any_split_gives_the_same_result(parts: list[str], data: st.DataObject):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    text = call.join(parts)
    whole = run(HermesExtractor(NAMES), [text])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(HermesExtractor(NAMES), pieces) == whole


def test_named_function_streams_its_arguments_as_they_come():
    ext = NamedExtractor("get_weather")
    first = ext.feed('{"ci')
    assert isinstance(first[0], CallStart) and first[0].name == "get_weather" and first[0].index == 0
    assert first[1] == CallArguments(0, '{"ci')
    assert ext.feed('ty": "Oslo"}') == [CallArguments(0, 'ty": "Oslo"}')]
    assert ext.finish() == []


def test_required_array_elements_become_calls_when_they_close():
    text = ('[{"name": "get_weather", "parameters": {"city": "a \\"}\\" b"}}, '
            '{"name": "add", "parameters": {"a": [1, {"b": 2}]}}]')
    content, calls = whole_and_by_char(ArrayExtractor, text)
    assert content == ""
    assert calls == [("get_weather", {"city": 'a "}" b'}), ("add", {"a": [1, {"b": 2}]})]
    ext = ArrayExtractor()
    pieces = ext.feed('[{"name": "add", "parameters": {"a": 1}}')
    assert [type(p) for p in pieces] == [CallStart, CallArguments]  # before the array closes


def test_required_array_cut_short_keeps_the_rest_as_content():
    content, calls = run(ArrayExtractor(), ['[{"name": "add", "parameters": {}}, {"name": "get_wea'])
    assert calls == [("add", {})]
    assert content == '{"name": "get_wea'


def test_content_pieces_are_content():
    assert HermesExtractor(NAMES).feed("hi there") == [Content("hi there")]
