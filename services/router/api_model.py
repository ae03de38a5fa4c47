"""The base of every OpenAI request body object: finite numbers only, the bounds the gRPC request carries, and the
refusal that names the field it is about.

Invariants: a model built on `ApiModel` refuses NaN and infinity wherever it takes a number; `Float32` and the
integer bounds are exactly what the proto's float32, uint32 and uint64 fields hold, so no validated body
overflows the gRPC request; every refusal a model raises itself is a `FieldError` whose message starts with
the field's name (the HTTP error's `param`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
F32_MAX = 3.4028234663852886e38  # the largest finite float32: a larger value would reach the engine as inf


class FieldError(ValueError):
    """A refusal from a model's own check, about `field` of the object being checked (its `param`); the
    message starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ApiModel(BaseModel):
    """Every body object: NaN and infinity are refused wherever a number is taken."""

    model_config = ConfigDict(allow_inf_nan=False)


Float32 = Annotated[float, Field(ge=-F32_MAX, le=F32_MAX)]
Text = Annotated[str, Field(min_length=1)]


def needs(**conditions: Any) -> dict[str, Any]:
    """JSON schema: a field present only with another field's value (`stream_options` needs `stream: true`),
    so generated and hand-written bodies alike know the rule the validator enforces."""
    return {
        "dependentSchemas": {
            field: {"required": [other], "properties": {other: {"const": value}}}
            for field, (other, value) in conditions.items()
        }
    }


def refusal(name: str, value: Any, neutral: tuple[Any, ...]) -> FieldError | None:
    """None where `value` is one of the field's `neutral` values (what leaving it out means), else the refusal
    naming the field and the value to send instead."""
    if value in neutral:
        return None
    hint = f" (or send {json.dumps(neutral[1])})" if len(neutral) > 1 else ""
    return FieldError(name, f"{name} is not supported by this server yet; leave it out{hint}")
