"""The traffic description `epd plan` and `epd bench traffic` read: request classes, reuse, load, targets.

YAML (or JSON, a subset of it)::

    requests:                       # one entry per kind of request; at least one
      - images: ["1344x1008"]       # source sizes WIDTHxHEIGHT, in prompt order (default: none)
        video_seconds: 0            # one video of this length per request (default 0: none; Qwen2-VL family)
        video_size: "1280x720"      # the video's frame size WIDTHxHEIGHT (required when video_seconds > 0)
        video_fps: 30               # its frame rate (default 30); the model samples its own rate from it
        text_tokens: 100            # text tokens of the prompt, chat template included (default 0)
        output_tokens: 200          # tokens generated (required, >= 1)
        share: 1.0                  # weight of this kind in the mix (default 1; normalised over the list)
    reuse: 0.0                      # share of image items whose embedding is already cached (0..1)
    rate: 2.0                       # open loop: requests per second (Poisson arrivals) ...
    concurrency: 1                  # ... or closed loop: clients each sending the next request on an answer
    ttft_ms: 2000                   # targets (optional): time to first token, inter-token latency
    itl_ms: 50

Invariants of a parsed `Traffic`: at least one class; shares > 0 summing to 1; at most one of `rate` and
`concurrency` (neither: one closed-loop client); every number within the ranges above. Anything else, an
unknown key included, raises `TrafficError` whose message names the field (`requests[1].output_tokens`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_CLASS_KEYS = {"images", "video_seconds", "video_size", "video_fps", "text_tokens", "output_tokens", "share"}
_TOP_KEYS = {"requests", "reuse", "rate", "concurrency", "ttft_ms", "itl_ms"}


class TrafficError(ValueError):
    """A traffic description that cannot be used; the message names the field and what it must be."""


@dataclass(frozen=True)
class RequestClass:
    """One kind of request of the mix; `images` are (width, height) source sizes in prompt order.

    Invariant: `video_size` is set exactly when `video_seconds > 0` (one video per request of this kind).
    """

    images: tuple[tuple[int, int], ...]
    text_tokens: int
    output_tokens: int
    share: float
    video_seconds: float = 0.0
    video_size: tuple[int, int] | None = None
    video_fps: float = 30.0

    def label(self) -> str:
        """A short name: `2 img 1344x1008 + 100 txt -> 200 out`, `video 10s 1280x720 + 50 txt -> 100 out`."""
        head = ""
        if self.images:
            sizes = sorted({f"{w}x{h}" for w, h in self.images})
            head = f"{len(self.images)} img {'/'.join(sizes)} + "
        if self.video_size is not None:
            head += f"video {self.video_seconds:g}s {self.video_size[0]}x{self.video_size[1]} + "
        return f"{head}{self.text_tokens} txt -> {self.output_tokens} out"


@dataclass(frozen=True)
class Traffic:
    """A parsed traffic description (see the module docstring)."""

    requests: tuple[RequestClass, ...]
    reuse: float = 0.0
    rate: float | None = None
    concurrency: int | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None

    @property
    def clients(self) -> int:
        """Closed-loop clients (1 when neither rate nor concurrency is given; 0 for an open-loop rate)."""
        if self.rate is not None:
            return 0
        return self.concurrency or 1


def load_traffic(path: Path) -> Traffic:
    """Read and check a traffic file; raises TrafficError naming the file (unreadable, not YAML, invalid)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TrafficError(f"cannot read traffic file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise TrafficError(f"traffic file {path} is not valid YAML{where}") from None
    try:
        return parse_traffic(data)
    except TrafficError as exc:
        raise TrafficError(f"traffic file {path}: {exc}") from None


def parse_traffic(data: Any) -> Traffic:
    """A `Traffic` from a parsed YAML/JSON document; raises TrafficError for anything out of range."""
    if not isinstance(data, Mapping):
        raise TrafficError("the traffic description must be a mapping with a `requests` list")
    _no_unknown(data, _TOP_KEYS, "")
    raw = data.get("requests")
    if not isinstance(raw, list) or not raw:
        raise TrafficError("requests: must be a non-empty list of request kinds")
    classes = [_request_class(item, f"requests[{i}]") for i, item in enumerate(raw)]
    total = sum(c.share for c in classes)
    classes = [replace(c, share=c.share / total) for c in classes]
    rate = _number(data, "rate", "", low=0.0, strict=True, default=None)
    concurrency = _whole(data, "concurrency", "", low=1, default=None)
    if rate is not None and concurrency is not None:
        raise TrafficError("rate and concurrency: give one (rate: open-loop requests/s; concurrency: clients)")
    return Traffic(
        requests=tuple(classes),
        reuse=_number(data, "reuse", "", low=0.0, high=1.0, default=0.0),
        rate=rate,
        concurrency=concurrency,
        ttft_ms=_number(data, "ttft_ms", "", low=0.0, strict=True, default=None),
        itl_ms=_number(data, "itl_ms", "", low=0.0, strict=True, default=None),
    )


def parse_size(text: Any, where: str) -> tuple[int, int]:
    """`"1344x1008"` -> (1344, 1008); raises TrafficError naming `where` otherwise."""
    match = _SIZE.match(str(text)) if isinstance(text, str) else None
    if match is None:
        raise TrafficError(f'{where}: must be a size WIDTHxHEIGHT such as "1344x1008", got {text!r}')
    width, height = int(match.group(1)), int(match.group(2))
    if width < 1 or height < 1:
        raise TrafficError(f"{where}: a size must be at least 1x1, got {text!r}")
    return width, height


def _request_class(item: Any, where: str) -> RequestClass:
    if not isinstance(item, Mapping):
        raise TrafficError(f"{where}: must be a mapping (images, text_tokens, output_tokens, share)")
    _no_unknown(item, _CLASS_KEYS, f"{where}.")
    images = item.get("images", [])
    if images is None:
        images = []
    if not isinstance(images, list):
        raise TrafficError(f'{where}.images: must be a list of sizes such as ["1344x1008"]')
    if "output_tokens" not in item:
        raise TrafficError(f"{where}.output_tokens: missing (tokens generated per request, >= 1)")
    video_seconds = _number(item, "video_seconds", f"{where}.", low=0.0, default=0.0)
    video_size = None
    if video_seconds > 0:
        if item.get("video_size") is None:
            raise TrafficError(f"{where}.video_size: missing (the video's WIDTHxHEIGHT, needed with video_seconds)")
        video_size = parse_size(item["video_size"], f"{where}.video_size")
    elif item.get("video_size") is not None or item.get("video_fps") is not None:
        raise TrafficError(f"{where}.video_seconds: must be above 0 when video_size or video_fps is given")
    return RequestClass(
        images=tuple(parse_size(s, f"{where}.images[{i}]") for i, s in enumerate(images)),
        text_tokens=_whole(item, "text_tokens", f"{where}.", low=0, default=0),
        output_tokens=_whole(item, "output_tokens", f"{where}.", low=1, default=None),
        share=_number(item, "share", f"{where}.", low=0.0, strict=True, default=1.0),
        video_seconds=video_seconds,
        video_size=video_size,
        video_fps=_number(item, "video_fps", f"{where}.", low=0.0, strict=True, default=30.0),
    )


def _no_unknown(data: Mapping[str, Any], known: set[str], prefix: str) -> None:
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise TrafficError(f"{prefix}{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")


def _number(
    data: Mapping[str, Any],
    key: str,
    prefix: str,
    *,
    low: float,
    high: float | None = None,
    strict: bool = False,
    default: float | None,
) -> Any:
    if key not in data or data[key] is None:
        return default
    value = data[key]
    bound = f"above {low:g}" if strict else f">= {low:g}"
    wanted = f"a number {bound}" + (f" and <= {high:g}" if high is not None else "")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TrafficError(f"{prefix}{key}: must be {wanted}, got {value!r}")
    if value < low or (strict and value == low) or (high is not None and value > high):
        raise TrafficError(f"{prefix}{key}: must be {wanted}, got {value!r}")
    return float(value)


def _whole(data: Mapping[str, Any], key: str, prefix: str, *, low: int, default: int | None) -> Any:
    if key not in data or data[key] is None:
        return default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TrafficError(f"{prefix}{key}: must be a whole number >= {low}, got {value!r}")
    return int(value)
