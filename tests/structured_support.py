"""What the structured-output tests share: constraints of every kind (bounded JSON schemas, any JSON object, a
regex, a choice, an EBNF grammar), the check that an output follows one, and the oracle, transformers'
`generate` run with xgrammar's own logits processor for the same constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
from PIL import Image
from transformers import LogitsProcessorList
from xgrammar.contrib.hf import LogitsProcessor as XgrammarProcessor

from services.common.grammar import Constraint, grammar_of
from services.common.rpc.epd.v1 import common_pb2
from services.models.base import ChatMessage
from services.worker.engine.request import SamplingOptions
from tests.oracle import _generate
from tests.oracle_processors import processors

COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}
SCHEMAS: dict[str, dict[str, Any]] = {
    "enum": COLOR,
    "string": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
    },
    "array": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "nested": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"enum": [1, 2, 3]}, "c": {"type": "string", "maxLength": 4}},
                "required": ["b", "c"],
            }
        },
        "required": ["a"],
    },
}
CHOICES = ["yes", "no", "maybe"]
CONSTRAINTS: dict[str, Constraint] = {
    **{name: Constraint("json_schema", json.dumps(schema)) for name, schema in SCHEMAS.items()},
    "spaced": Constraint("json_schema", json.dumps(COLOR), any_whitespace=True),
    "object": Constraint("json_object"),
    "regex": Constraint("regex", r"[a-z]{2,6}-\d{3}"),
    "choice": Constraint("choice", json.dumps(CHOICES)),
    "grammar": Constraint("grammar", 'root ::= "(" [0-9] [0-9]? ("+" [0-9] [0-9]?)? ")"'),
}


def oracle(
    model_dir: Path,
    messages: list[ChatMessage],
    images: list[Image.Image],
    opts: SamplingOptions,
    compiler: Any,
    eos: list[int],
    constrained: bool = True,
) -> list[int]:
    """``generate`` greedy over xgrammar's processor (its mask first, as the engine) then ``opts``' processors."""
    masks = [XgrammarProcessor(compiler.compile_grammar(grammar_of(opts.structured)))] if constrained else []
    stops = [] if opts.ignore_eos else list(eos)
    kwargs = {"logits_processor": LogitsProcessorList([*masks, *processors(opts, eos)]), "eos_token_id": stops}
    out, prompt_len = _generate(model_dir, messages, images, opts.max_tokens, **kwargs)
    return out[0, prompt_len:].tolist()


def check_valid(name: str, constraint: Constraint, text: str) -> None:
    """AssertionError (or jsonschema's) unless ``text`` is a complete answer ``constraint`` accepts."""
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.text))
        if not constraint.any_whitespace:
            assert text == json.dumps(json.loads(text), ensure_ascii=False), f"{name}: not compact: {text!r}"
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.text, text), text
    elif constraint.kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\(\d\d?(\+\d\d?)?\)", text), text


def set_structured(sampling: common_pb2.SamplingParams, constraint: Constraint) -> None:
    """``constraint`` written into the proto's oneof (and ``any_whitespace``), as a gRPC client sends it."""
    if constraint.kind == "json_object":
        sampling.json_object = True
    elif constraint.kind == "choice":
        sampling.choice.choices.extend(json.loads(constraint.text))
    else:
        setattr(sampling, constraint.kind, constraint.text)
    if constraint.is_json:
        sampling.any_whitespace = constraint.any_whitespace
