"""Structured-output constraints of a request body: OpenAI's `response_format`, vLLM's `structured_outputs` and its
older `guided_*` fields, validated and set on `SamplingParams`.

Invariants: a constraint surely longer than the router's limit is refused before any schema is written out as
text; a schema sent as an object reaches the engine as JSON text, one sent as text as sent; at most one
constraint per request (the body's validator refuses a second, naming it).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from services.common.rpc.epd.v1 import common_pb2
from services.router.api_model import ApiModel, FieldError
from services.router.constraint_size import ConstraintTooLarge, check_constraint_size

MAX_CONSTRAINT_BYTES = "max_constraint_bytes"
"""The validation context's key for the router's EPD_STRUCTURED_MAX_BYTES: a structured-output constraint
surely longer is refused while the body is validated, before it is written out as text (services/router/
constraint_size.py; without it the router's own check refuses it later, at the cost of that text)."""

Schema = dict[str, Any] | bool


class JsonSchemaFormat(ApiModel):
    """`response_format.json_schema`: the schema (`strict` accepted either way: every schema is enforced)."""

    model_config = ConfigDict(allow_inf_nan=False, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: Schema = Field(alias="schema", description="the JSON Schema the answer follows")
    strict: bool | None = None


class TextFormat(ApiModel):
    type: Literal["text"]


class JsonObjectFormat(ApiModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(ApiModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputs(ApiModel):
    """vLLM's `structured_outputs`: one of `json`, `regex`, `choice`, `grammar`, `json_object`."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    json_: Schema | str | None = Field(None, alias="json", description="a JSON Schema (an object or its text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="an EBNF grammar (xgrammar's; start rule `root`)")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(None, description="true: compact JSON; default the server's")
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputs:
        for name in ("whitespace_pattern", "structural_tag"):
            if (self.model_extra or {}).get(name) is not None:
                raise FieldError(name, f"{name} is not supported by this server yet")
        return self


def schema_text(field: str, schema: Any) -> str:
    """A schema sent as an object, as JSON text (one sent as text is kept as sent); FieldError for one nested
    too deep to write out (the router's depth limit refuses far shallower ones)."""
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise FieldError(field, f"{field} is nested too deeply") from None


def constraints(
    fmt: ResponseFormat | None, so: StructuredOutputs | None, extra: dict[str, Any], max_bytes: int | None
) -> list[tuple[str, str, Any]]:
    """Every constraint a body sets by its `response_format`, `structured_outputs` and other fields (``extra``,
    where the `guided_*` ones are): (HTTP field, SamplingParams field, value), each schema as JSON text;
    FieldError for one surely over ``max_bytes`` (checked before any schema is written out)."""
    sent: list[tuple[str, str, Any]] = []
    if isinstance(fmt, JsonObjectFormat):
        sent.append(("response_format", "json_object", True))
    elif isinstance(fmt, JsonSchemaResponseFormat):
        sent.append(("response_format.json_schema.schema", "json_schema", fmt.json_schema.schema_))
    if so is not None:
        if so.json_ is not None:
            sent.append(("structured_outputs.json", "json_schema", so.json_))
        for name in ("regex", "choice", "grammar"):
            if getattr(so, name) is not None:
                sent.append((f"structured_outputs.{name}", name, getattr(so, name)))
        if so.json_object:
            sent.append(("structured_outputs.json_object", "json_object", True))
    if extra.get("guided_json") is not None:
        sent.append(("guided_json", "json_schema", extra["guided_json"]))
    for name in ("regex", "choice", "grammar"):
        if extra.get(f"guided_{name}") is not None:
            sent.append((f"guided_{name}", name, extra[f"guided_{name}"]))
    for field, kind, value in sent:
        try:
            if kind != "json_object":
                check_constraint_size(field, value, max_bytes)
        except ConstraintTooLarge as exc:
            raise FieldError(exc.field, str(exc)) from None
    return [(field, kind, schema_text(field, value) if kind == "json_schema" else value) for field, kind, value in sent]


def set_constraint(sampling: common_pb2.SamplingParams, kind: str, value: Any, field: str) -> None:
    if kind == "json_object":
        sampling.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise FieldError(field, f"{field} must be an array of strings")
        sampling.choice.choices.extend(value)
    else:
        if not isinstance(value, str):
            raise FieldError(field, f"{field} must be a string")
        setattr(sampling, kind, value)
