"""Tool calling: what the chat template sees, and which constraint forces a call.

`tool_choice`:
- `none` (the default without tools): the tools are not offered to the model.
- `auto` (the default with tools): the tools are offered; the output is free, and calls written as
  Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks are taken out of
  it (tool_parser.py).
- `required`: the output is forced to a JSON array of `{"name", "parameters"}` objects, one per
  call, each naming an offered tool with arguments that follow its schema (vLLM's shape; one call
  at most with `parallel_tool_calls: false`).
- a named function: the output is forced to that function's arguments object (as vLLM does).

The chat template gets the tools as transformers' `apply_chat_template(tools=...)` gives them,
and earlier calls as `tool_calls` on assistant messages (arguments as objects, as vLLM passes
them), when the template mentions tools at all. A template that does not (SmolLM2's) gets the
fallback instead: the tool list and the way to call them written into the system prompt, earlier
calls as `<tool_call>` blocks in the assistant's content, and tool results as `<tool_response>`
blocks in the tool message's content. Either way, everything a client wrote reaches the model as
plain text, never as control tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from cadence.server.json_text import TOO_DEEP, parse_json
from cadence.server.protocol import ChatCompletionRequest, ChatMessage, Tool
from cadence.server.structured import Constraint, check_json_schema, closed_objects, json_constraint
from cadence.server.tool_parser import ArrayExtractor, Extractor, HermesExtractor, NamedExtractor

ToolMode = Literal["none", "auto", "required", "named"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

FALLBACK_PREAMBLE = (
    "You may call one or more functions to help with the user's request. For each call, answer with "
    "a JSON object holding the function's name and its arguments within <tool_call></tool_call> XML "
    "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-json-object>}\n</tool_call>\n"
    "The functions, as JSON schemas within <tools></tools> XML tags:\n<tools>\n"
)


@dataclass(frozen=True)
class ToolPlan:
    """The request's tools and how they are used."""

    mode: ToolMode
    tools: tuple[Tool, ...] = ()  # the tools offered ((): none)
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.function.name for t in self.tools)

    def constraint(self) -> Constraint | None:
        """The grammar that forces the call(s): for `required` and a named function only."""
        if self.mode == "named":
            assert self.named is not None
            i = self.names.index(self.named)
            return Constraint(json_constraint(parameters_of(self.tools[i])), "tool_choice",
                              f"tools[{i}].function.parameters")
        if self.mode != "required":
            return None
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": [_call_schema(t) for t in self.tools]},
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return Constraint(json_constraint(calls), "tool_choice", "tools")

    def extractor(self) -> Callable[[], Extractor] | None:
        """What reads calls out of the output (None: no tools, the output is all content)."""
        if self.mode == "auto":
            names, parallel = self.names, self.parallel
            return lambda: HermesExtractor(names, parallel)
        if self.mode == "required":
            return ArrayExtractor
        if self.mode == "named":
            name = self.named
            assert name is not None
            return lambda: NamedExtractor(name)
        return None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template gets them (None: not offered)."""
        if self.mode == "none" or not self.tools:
            return None
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]


NO_TOOLS = ToolPlan("none")


def parameters_of(tool: Tool) -> dict[str, Any]:
    """The schema a forced call's arguments follow: the tool's, its objects closed to properties it
    does not declare (as OpenAI's strict function calling and vLLM's default backend have it)."""
    params = tool.function.parameters
    # A schema that leaves the type open still describes an arguments object (OpenAI's convention)
    schema: dict[str, Any] = closed_objects({"type": "object", **params} if params else EMPTY_PARAMETERS)
    return schema


def check_parameters(params: dict[str, Any], field: str) -> None:
    """A call's arguments are a JSON object: a `parameters` schema of any other type is refused
    (OpenAI's rule), since a call forced to it could not be read as arguments."""
    check_json_schema(params, field)
    kind = params.get("type", "object")
    if kind != "object":
        raise ValueError(f'{field}: must describe the arguments object ("type": "object"), not {json.dumps(kind)}')


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": parameters_of(tool),
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,  # a call is its name and its arguments, nothing else
    }


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The request's ToolPlan; ValueError (naming the field) for a choice the tools cannot meet."""
    tools = tuple(body.tools or ())
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise ValueError(f"tools[{i}].function.name: {name!r} is given twice")
        seen.add(name)
        if tool.function.parameters is not None:
            check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if choice is None:
        return ToolPlan("auto" if tools else "none", tools, parallel=parallel)
    if choice == "none":
        return ToolPlan("none", tools, parallel=parallel)
    if not tools:
        raise ValueError(f"tool_choice: {_spell(choice)} needs tools, and the request gives none")
    if isinstance(choice, str):
        return ToolPlan(choice, tools, parallel=parallel)
    name = choice.function.name
    if name not in seen:
        raise ValueError(f"tool_choice: names the function {name!r}, which is not among the tools "
                         f"({', '.join(sorted(seen))})")
    return ToolPlan("named", tools, named=name, parallel=parallel)


def _spell(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else "a named function"


def template_mentions_tools(source: str | None) -> bool:
    """Whether a chat template handles tools itself (else the fallback renders them)."""
    return source is not None and "tools" in source


def _arguments(i: int, j: int, text: str) -> Any:
    try:
        return parse_json(text)
    except ValueError as e:
        why = e if str(e) == TOO_DEEP else "not valid JSON"
        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments: {why}") from None


def template_messages(messages: list[ChatMessage], plan: ToolPlan, native: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template gets it: natively (`native`, the template handles
    tools) or through the fallback."""
    out = []
    for i, m in enumerate(messages):
        d = m.as_template_input()
        calls = [(c, _arguments(i, j, c.function.arguments)) for j, c in enumerate(m.tool_calls or ())]
        if native:
            if calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": args}} for c, args in calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        else:
            if calls:
                blocks = [_call_block(c.function.name, args) for c, args in calls]
                d["content"] = "\n".join(([d["content"]] if d["content"] else []) + blocks)
            if m.role == "tool":
                d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
        out.append(d)
    tools = plan.template_tools()
    if not native and tools:
        out = _with_tools_in_system_prompt(out, tools)
    return out


def _call_block(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def fallback_system_text(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return FALLBACK_PREAMBLE + listed + "\n</tools>"


def _with_tools_in_system_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    text = fallback_system_text(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
