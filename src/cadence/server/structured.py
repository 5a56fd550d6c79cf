"""The request fields that constrain what a request may generate, as one `StructuredOutputsParams`.

OpenAI's `response_format` and vLLM's `guided_*` fields and `structured_outputs` object all say the
same kind of thing; a request may say it once. What needs no model is checked here: that a schema
is a JSON schema (against its metaschema), sizes, the options cadence does not implement. Whether
the grammar library accepts the constraint (a keyword it does not support, a regex it refuses) is
checked by compiling it before the request reaches the engine (inputs.py). Every refusal is a
ValueError that starts with the request field at fault, as the server's errors do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cadence.request import StructuredOutputsParams
from cadence.server.json_text import TOO_DEEP, parse_json
from cadence.server.protocol import MAX_GRAMMAR_CHARS, StructuredFields, StructuredOutputsField

# The JSON text of one schema (a response format's, a guided_json, a tool's parameters).
MAX_SCHEMA_CHARS = 65536
# guided_decoding_backend: vLLM's backend names (with or without its ":option" suffixes) are taken,
# so that a vLLM client's request runs unchanged; whichever is named, the constraint is compiled by
# llguidance ("guidance" in vLLM's spelling) and holds the same. A name vLLM does not know is refused.
GRAMMAR_BACKEND = "guidance"
ACCEPTED_BACKENDS = ("auto", GRAMMAR_BACKEND, "llguidance", "xgrammar", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class Constraint:
    """A constraint and the request field it came from; `schema_field` is the one a compile error
    names, when another field than `field` holds what the grammar was made from (a tool's schema)."""

    params: StructuredOutputsParams
    field: str
    schema_field: str | None = None

    def compile_error(self, error: ValueError) -> ValueError:
        """The grammar library's refusal ("structured_outputs.json: why") in the request's own terms."""
        message = str(error)
        head, sep, why = message.partition(": ")
        if sep and head.startswith("structured_outputs"):
            message = why
        return ValueError(f"{self.schema_field or self.field}: {message}")


def check_json_schema(schema: Any, field: str) -> dict[str, Any] | bool:
    """`schema` (an object, a boolean, or its JSON text) as a JSON value, checked against the
    JSON Schema metaschema it declares (2020-12 when it declares none)."""
    if isinstance(schema, str):
        try:
            schema = parse_json(schema)
        except ValueError as e:
            raise ValueError(f"{field}: not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object (or true/false)")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_CHARS:
        raise ValueError(f"{field}: the schema is {size} characters of JSON, over the limit of {MAX_SCHEMA_CHARS}")
    from jsonschema import validators
    from jsonschema.exceptions import SchemaError

    try:
        validators.validator_for(schema).check_schema(schema)
    except RecursionError:
        # Subschemas nested past the limit, or a `pattern` whose groups are (Python's re checks it).
        raise ValueError(f"{field}: {TOO_DEEP}") from None
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"{field}: not a valid JSON schema{f' (at {where})' if where else ''}: "
                         f"{_short(e.message)}") from None
    return schema


def json_constraint(schema: dict[str, Any] | bool) -> StructuredOutputsParams:
    """The constraint "JSON that follows `schema`". StructuredOutputsParams takes the schema as an
    object too and keeps it as its canonical JSON text (the order of `properties` kept)."""
    return StructuredOutputsParams(json=schema)  # type: ignore[arg-type]


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not say
    otherwise (vLLM's `disable_additional_properties`, OpenAI's strict mode)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _grammar(text: str, field: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{field}: the grammar is {len(text)} characters, over the limit of {MAX_GRAMMAR_CHARS}")
    return text


def _from_response_format(body: StructuredFields) -> Constraint | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    assert rf.json_schema is not None  # the protocol requires it with this type
    schema = check_json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")
    return Constraint(json_constraint(closed_objects(schema) if rf.json_schema.strict else schema), "response_format")


def _from_guided(body: StructuredFields) -> list[Constraint]:
    found = []
    if body.guided_json is not None:
        found.append(Constraint(json_constraint(check_json_schema(body.guided_json, "guided_json")), "guided_json"))
    if body.guided_regex is not None:
        found.append(Constraint(StructuredOutputsParams(regex=body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append(Constraint(StructuredOutputsParams(choice=tuple(body.guided_choice)), "guided_choice"))
    if body.guided_grammar is not None:
        found.append(Constraint(StructuredOutputsParams(grammar=_grammar(body.guided_grammar, "guided_grammar")),
                                "guided_grammar"))
    return found


def _from_structured_outputs(so: StructuredOutputsField) -> Constraint:
    field = "structured_outputs"
    for option, why in (("whitespace_pattern", "a whitespace pattern"), ("structural_tag", "structural tags")):
        if getattr(so, option) is not None:
            raise ValueError(f"{field}.{option}: not supported ({why}); leave it out")
    # disable_any_whitespace: either value is met, the JSON cadence generates being compact already.
    given = [name for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                      ("grammar", so.grammar), ("json_object", so.json_object or None))
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"{field}: give exactly one of json, regex, choice, grammar, json_object"
                         + (f" (got {', '.join(given)})" if given else ""))
    if so.json_ is not None:
        schema = check_json_schema(so.json_, f"{field}.json")
        if so.disable_additional_properties:
            schema = closed_objects(schema)
        return Constraint(json_constraint(schema), field)
    if so.regex is not None:
        return Constraint(StructuredOutputsParams(regex=so.regex), field)
    if so.choice is not None:
        return Constraint(StructuredOutputsParams(choice=tuple(so.choice)), field)
    if so.grammar is not None:
        return Constraint(StructuredOutputsParams(grammar=_grammar(so.grammar, f"{field}.grammar")), field)
    return Constraint(StructuredOutputsParams(json_object=True), field)


def _check_backend(body: StructuredFields) -> None:
    backend = body.guided_decoding_backend
    if backend is not None and backend.split(":", 1)[0] not in ACCEPTED_BACKENDS:
        raise ValueError(f"guided_decoding_backend: {backend[:64]!r} is not a backend this server knows; "
                         f"give one of {', '.join(ACCEPTED_BACKENDS)} (all served by llguidance) or leave it out")
    if body.guided_whitespace_pattern is not None:
        raise ValueError("guided_whitespace_pattern: not supported (a whitespace pattern); leave it out")


def only_one(found: list[Constraint]) -> Constraint | None:
    """The one constraint asked for, None for none; two are refused, naming both fields."""
    if len(found) > 1:
        a, b = found[0].field, found[1].field
        raise ValueError(f"{a}: {a} and {b} both constrain the output; give one of them")
    return found[0] if found else None


def request_constraints(body: StructuredFields) -> list[Constraint]:
    """Every constraint the request's structured-output fields ask for, checked (none: [])."""
    _check_backend(body)
    found = []
    rf = _from_response_format(body)
    if rf is not None:
        found.append(rf)
    found += _from_guided(body)
    if body.structured_outputs is not None:
        found.append(_from_structured_outputs(body.structured_outputs))
    return found
