"""A hardware profile: fitted cost curves of one model on one machine, as `epd profile` writes them (JSON).

Curves (seconds; each a `LinearFit` over named terms with coefficients >= 0):

- `prepare(megapixels)`: decode, colour conversion, resize, normalise and patchify of one image, against its
  source size (the encoder's CPU work before the tower);
- `tower(tokens)`: one image through the vision tower and projector, `1 + tokens + tokens^2` (attention
  within an image is quadratic);
- `prefill(tokens)`: a whole prompt through the worker engine to its first token, `1 + tokens + tokens^2`;
- `decode(batch, context)`: one engine decode step, `1 + batch + batch*context` (weights read once per step,
  KV read per sequence and token of context);
- `transports[name](megabytes)`: one embedding moved by `grpc` (push to a worker), `gloo` (torch.distributed),
  `redis_put` / `redis_get` (the embedding cache), `1 + megabytes` (latency + bytes / bandwidth);
- `serving(output_tokens, images, image_tokens)`: what a request through the real cluster costs beyond the
  parts above (router intake, gRPC hops, streaming each token, the encoder's batching wait and process hops),
  fitted to probe requests' measured time minus the parts' prediction (text probes first, then images).

Invariant: a profile read back (`load_profile`) equals the one written; a file of another schema or
missing a curve raises `ProfileError` naming what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.capacity.fit import FitError, LinearFit

SCHEMA = "epd-profile-v1"
PREPARE_TERMS = ("1", "megapixels")
TOWER_TERMS = ("1", "tokens", "tokens*tokens")
PREFILL_TERMS = ("1", "tokens", "tokens*tokens")
DECODE_TERMS = ("1", "batch", "batch*context")
TRANSPORT_TERMS = ("1", "megabytes")
SERVING_TERMS = ("1", "output_tokens", "images", "image_tokens")
TRANSPORTS = ("grpc", "gloo", "redis_put", "redis_get")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Profile:
    """Fitted curves (see the module docstring), the raw points they were fitted to, and where they were measured."""

    model: dict[str, Any]
    hardware: dict[str, Any]
    dtype: str
    prepare: LinearFit
    tower: LinearFit
    prefill: LinearFit
    decode: LinearFit
    transports: dict[str, LinearFit]
    serving: LinearFit
    points: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    measured_s: float = 0.0

    def image_encode_s(self, megapixels: float, tokens: int) -> float:
        """prepare + tower of one image."""
        return self.prepare(megapixels=megapixels) + self.tower(tokens=tokens)

    def transfer_s(self, transport: str, nbytes: float) -> float:
        """Seconds to move `nbytes` by `transport` (0 bytes: nothing moves, 0 s)."""
        if nbytes <= 0:
            return 0.0
        return self.transports[transport](megabytes=nbytes / 1e6)

    def megabytes_per_s(self, transport: str) -> float:
        """The transport's bandwidth (1 / its per-megabyte slope; inf when the fit found none)."""
        slope = self.transports[transport].coefficient("megabytes")
        return 1.0 / slope if slope > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "hardware": self.hardware,
            "dtype": self.dtype,
            "measured_s": self.measured_s,
            "fits": {
                "prepare": self.prepare.to_json(),
                "tower": self.tower.to_json(),
                "prefill": self.prefill.to_json(),
                "decode": self.decode.to_json(),
                "serving": self.serving.to_json(),
                "transports": {name: f.to_json() for name, f in self.transports.items()},
            },
            "megabytes_per_s": {name: _finite(self.megabytes_per_s(name)) for name in self.transports},
            "points": self.points,
        }

    @classmethod
    def from_json(cls, data: Any) -> Profile:
        """Raises ProfileError for another schema or a missing or malformed curve."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ProfileError(f"not an epd profile (schema {found!r}, expected {SCHEMA!r})")
        try:
            fits = data["fits"]
            transports = {name: LinearFit.from_json(fits["transports"][name]) for name in TRANSPORTS}
            return cls(
                model=dict(data.get("model", {})),
                hardware=dict(data.get("hardware", {})),
                dtype=str(data["dtype"]),
                prepare=LinearFit.from_json(fits["prepare"]),
                tower=LinearFit.from_json(fits["tower"]),
                prefill=LinearFit.from_json(fits["prefill"]),
                decode=LinearFit.from_json(fits["decode"]),
                transports=transports,
                serving=LinearFit.from_json(fits["serving"]),
                points={k: list(v) for k, v in data.get("points", {}).items()},
                measured_s=float(data.get("measured_s", 0.0)),
            )
        except KeyError as exc:
            raise ProfileError(f"the profile lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError, FitError) as exc:
            raise ProfileError(f"a malformed curve: {exc}") from None


def _finite(value: float) -> float | None:
    return value if value != float("inf") else None


def save_profile(profile: Profile, path: Path) -> None:
    """Write the profile as indented JSON (parent folders made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8")


def load_profile(path: Path) -> Profile:
    """Read a profile file; raises ProfileError naming the file when it is unreadable, not JSON or not a profile."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path} is not JSON (line {exc.lineno})") from None
    try:
        return Profile.from_json(data)
    except ProfileError as exc:
        raise ProfileError(f"profile {path}: {exc}") from None
