"""The cost model behind `epd plan`: a request's sizes from the model's config, its times from a profile.

Per request kind (times in seconds, from `profile.py`'s curves; B = sequences decoding together on a worker,
h = `reuse`, the share of image items already in the embedding cache):

    encode      = sum over images of prepare(megapixels) + tower(tokens)          (a cache miss)
                + per video, frames x prepare(frame megapixels) + groups x tower(tokens / groups)
    cache_write = sum over items of redis_put(embedding bytes)                     (the encoder writes every miss)
    cache_read  = sum over items of redis_get(embedding bytes)                     (the worker reads every hit)
    transfer    = transport(all the request's embedding bytes)                     (one push, disaggregated only)
    prefill     = prefill(text + image tokens)
    decode      = (output - 1) x decode(B, prompt + output / 2)
    serving     = serving(output, images, image tokens)                            (router, RPC hops, streaming)
    disaggregated = serving + (1 - h)(encode + cache_write + transfer) + h cache_read + prefill + decode
    co-located    = serving + (1 - h)(encode + cache_write) + h cache_read + prefill + decode x stretch
    stretch     = 1 / (1 - rho x (1 - 1/B)),  rho = worker's request rate x (1 - h) encode
                  (a co-located worker runs the tower between the decode steps of its other B - 1 sequences)
    TTFT        = the same without the decode and with serving at one output token
    ITL         = decode(B, context) + serving's per-token term  (co-located worst case: + one request's encode)

A video's frames are costed as images of the frame's size (decoding one frame of a compressed stream and
preprocessing it is taken to cost what decoding and preprocessing an image does: an estimate, not profiled), and
its tower as one tower call per temporal patch group (Qwen2-VL's tower attends within a group), so `h` counts
videos among the items.

Load (a stated simplification: no queueing delay is modelled, only how batching and shared time stretch a
request): N requests are in the system, `concurrency` for closed-loop clients or rate x T (Little's law) for an
open-loop rate, solved as a fixed point because T depends on B. Workers = the fewest such that B = N / workers
keeps ITL within `itl_ms` (when given; at most `MAX_BATCH` sequences) and, for an open-loop rate, no worker is
busier than `UTILISATION` (a closed loop queues no deeper than its clients); encoders = the fewest none of which
is busier than `UTILISATION` at the resulting request rate. Busy time per request: a worker's prefill + decode / B
(+ encode when co-located); an encoder's (1 - h)(encode + cache_write). The encoder:worker ratio is their busy
time per request, encoder over worker.

Caching pays when a hit rate h makes (1 - h)(encode + write + transfer) + h read smaller than encode + transfer
(no cache: no write, no read): h > write / (encode + write + transfer - read); never when reading costs as much as
encoding and moving the embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.capacity.model_sizes import ImageSize, ModelSizes, VideoSize
from services.capacity.profile import Profile
from services.capacity.traffic import RequestClass, Traffic, TrafficError

UTILISATION = 0.8
"""The busiest a pool is planned to be (queues stay short below it)."""
MAX_BATCH = 64
"""The most sequences a worker is planned to decode at once (the worker's default EPD_MAX_NUM_SEQS)."""
_ITERATIONS = 100


@dataclass(frozen=True)
class KindSizes:
    """One request kind's sizes (no profile needed). Invariant: `prompt_tokens = text + image + video tokens`."""

    label: str
    share: float
    images: tuple[ImageSize, ...]
    text_tokens: int
    output_tokens: int
    videos: tuple[VideoSize, ...] = ()

    @property
    def image_tokens(self) -> int:
        return sum(i.tokens for i in self.images)

    @property
    def image_tokens_uncapped(self) -> int | None:
        counts = [i.tokens_uncapped for i in self.images]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)

    @property
    def video_tokens(self) -> int:
        return sum(v.tokens for v in self.videos)

    @property
    def media_items(self) -> int:
        return len(self.images) + len(self.videos)

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + self.image_tokens + self.video_tokens

    @property
    def embedding_bytes(self) -> int:
        return sum(i.embedding_bytes for i in self.images) + sum(v.embedding_bytes for v in self.videos)


def kind_sizes(sizes: ModelSizes, kind: RequestClass, index: int = 0) -> KindSizes:
    """Tokens and bytes of one request kind; raises TrafficError for a video the model cannot take."""
    images = tuple(sizes.image(w, h) for w, h in kind.images)
    videos: tuple[VideoSize, ...] = ()
    if kind.video_size is not None:
        try:
            videos = (sizes.video(*kind.video_size, kind.video_seconds, kind.video_fps),)
        except ValueError as exc:
            raise TrafficError(f"requests[{index}].video_seconds: {exc}") from None
    return KindSizes(kind.label(), kind.share, images, kind.text_tokens, kind.output_tokens, videos)


@dataclass(frozen=True)
class KindTimes:
    """One request kind's predicted seconds at a batch and hit rate (module docstring's formulas)."""

    encode_s: float
    cache_write_s: float
    cache_read_s: float
    transfer_s: float
    prefill_s: float
    decode_s: float
    serving_s: float
    first_token_serving_s: float
    step_s: float
    token_s: float
    hit_rate: float
    stretch: float

    @property
    def miss(self) -> float:
        return 1.0 - self.hit_rate

    @property
    def disaggregated_s(self) -> float:
        encoder = self.miss * (self.encode_s + self.cache_write_s + self.transfer_s) + self.hit_rate * self.cache_read_s
        return self.serving_s + encoder + self.prefill_s + self.decode_s

    @property
    def colocated_s(self) -> float:
        encoder = self.miss * (self.encode_s + self.cache_write_s) + self.hit_rate * self.cache_read_s
        return self.serving_s + encoder + self.prefill_s + self.decode_s * self.stretch

    @property
    def ttft_s(self) -> float:
        encoder = self.miss * (self.encode_s + self.cache_write_s + self.transfer_s) + self.hit_rate * self.cache_read_s
        return self.first_token_serving_s + encoder + self.prefill_s

    @property
    def itl_s(self) -> float:
        return self.step_s + self.token_s

    @property
    def encoder_busy_s(self) -> float:
        return self.miss * (self.encode_s + self.cache_write_s)


class CostModel:
    """Times of request kinds for one model's sizes and one profile (module docstring)."""

    def __init__(self, sizes: ModelSizes, profile: Profile, transport: str = "grpc") -> None:
        if transport not in profile.transports:
            raise ValueError(f"the profile has no transport {transport!r} (it has {', '.join(profile.transports)})")
        self.sizes = sizes
        self.profile = profile
        self.transport = transport

    def times(self, kind: KindSizes, batch: float, hit_rate: float, encode_load: float = 0.0) -> KindTimes:
        """`kind`'s times with `batch` sequences decoding per worker, a share `hit_rate` of its images cached, and
        (co-located) `encode_load` = the share of a worker's time spent running the tower."""
        p = self.profile
        batch = max(1.0, batch)
        encode = sum(p.image_encode_s(i.width * i.height / 1e6, i.tokens) for i in kind.images)
        encode += sum(video_encode_s(p, v) for v in kind.videos)
        items = [i.embedding_bytes for i in kind.images] + [v.embedding_bytes for v in kind.videos]
        write = sum(p.transfer_s("redis_put", nbytes) for nbytes in items)
        read = sum(p.transfer_s("redis_get", nbytes) for nbytes in items)
        transfer = p.transfer_s(self.transport, kind.embedding_bytes)
        context = kind.prompt_tokens + kind.output_tokens / 2
        step = p.decode(batch=batch, context=context)
        images, image_tokens = kind.media_items, kind.image_tokens + kind.video_tokens
        overhead = p.serving(output_tokens=kind.output_tokens, images=images, image_tokens=image_tokens)
        first = p.serving(output_tokens=1, images=images, image_tokens=image_tokens)
        others = encode_load * (1.0 - 1.0 / batch)
        return KindTimes(
            encode_s=encode,
            cache_write_s=write,
            cache_read_s=read,
            transfer_s=transfer,
            prefill_s=p.prefill(tokens=kind.prompt_tokens),
            decode_s=max(0, kind.output_tokens - 1) * step,
            serving_s=overhead,
            first_token_serving_s=first,
            step_s=step,
            token_s=p.serving.coefficient("output_tokens"),
            hit_rate=hit_rate,
            stretch=1.0 / (1.0 - others) if others < 1.0 else math.inf,
        )

    def step_s(self, batch: float, context: float) -> float:
        return self.profile.decode(batch=max(1.0, batch), context=context)


def video_encode_s(profile: Profile, video: VideoSize) -> float:
    """Every sampled frame prepared as an image of its size, and one tower call per temporal group."""
    prepare = video.frames * profile.prepare(megapixels=video.width * video.height / 1e6)
    return prepare + video.temporal_groups * profile.tower(tokens=video.tokens / video.temporal_groups)


@dataclass(frozen=True)
class MixTimes:
    """Share-weighted means over the kinds of a mix at one load."""

    per_kind: tuple[KindTimes, ...]
    shares: tuple[float, ...]

    def mean(self, name: str) -> float:
        return sum(s * getattr(t, name) for s, t in zip(self.shares, self.per_kind, strict=True))


@dataclass(frozen=True)
class Load:
    """A solved load: requests in the system, per-worker batch, pool sizes, request rate, and the mix's times."""

    mode: str  # "disaggregated" | "co-located"
    in_system: float
    batch: float
    workers: int
    encoders: int
    rate: float
    times: MixTimes
    stable: bool

    @property
    def request_s(self) -> float:
        return self.times.mean("disaggregated_s" if self.mode == "disaggregated" else "colocated_s")


def mix_times(model: CostModel, kinds: list[KindSizes], batch: float, hit_rate: float, encode_load: float) -> MixTimes:
    return MixTimes(tuple(model.times(k, batch, hit_rate, encode_load) for k in kinds), tuple(k.share for k in kinds))


def largest_batch(model: CostModel, kinds: list[KindSizes], itl_s: float | None) -> int:
    """The largest batch (<= MAX_BATCH, >= 1) whose mean inter-token latency stays within `itl_s` (None: any)."""
    if itl_s is None:
        return MAX_BATCH
    context = sum(k.share * (k.prompt_tokens + k.output_tokens / 2) for k in kinds)
    token_s = model.profile.serving.coefficient("output_tokens")
    best = 1
    for batch in range(1, MAX_BATCH + 1):
        if model.step_s(batch, context) + token_s <= itl_s:
            best = batch
    return best


def solve_load(
    model: CostModel,
    kinds: list[KindSizes],
    traffic: Traffic,
    mode: str,
    workers: int | None = None,
    rate: float | None = None,
) -> Load:
    """The fixed point of the module docstring's load model for `mode` ("disaggregated" or "co-located").

    `workers` fixes the worker count (None: plan it); `rate` overrides the traffic's load with an open-loop rate.
    """
    if mode not in ("disaggregated", "co-located"):
        raise ValueError(f"mode must be disaggregated or co-located, got {mode!r}")
    colocated = mode == "co-located"
    metric = "colocated_s" if colocated else "disaggregated_s"
    hit = traffic.reuse
    open_rate = rate if rate is not None else traffic.rate
    cap = largest_batch(model, kinds, traffic.itl_ms / 1000 if traffic.itl_ms else None)
    batch, count, encode_load = 1.0, workers or 1, 0.0
    times = mix_times(model, kinds, batch, hit, encode_load)
    in_system, throughput, stable = 1.0, 0.0, True
    for _ in range(_ITERATIONS):
        request_s = times.mean(metric)
        if not math.isfinite(request_s):
            stable = False
            break
        if open_rate is not None:
            in_system, throughput = open_rate * request_s, open_rate
        else:
            in_system = float(traffic.clients)
            throughput = in_system / request_s
        busy = times.mean("prefill_s") + times.mean("decode_s") / batch
        if colocated:
            busy += times.mean("encoder_busy_s")
        if workers is None:  # closed loops queue no deeper than their clients: only open loops need headroom
            headroom = math.ceil(throughput * busy / UTILISATION) if open_rate is not None else 1
            count = max(1, math.ceil(in_system / cap), headroom)
        new_batch = max(1.0, in_system / count)
        encode_load = (throughput / count) * times.mean("encoder_busy_s") if colocated else 0.0
        stable = throughput * busy / count < 1.0 and encode_load < 1.0
        new_times = mix_times(model, kinds, new_batch, hit, min(encode_load, 0.999))
        if abs(new_batch - batch) < 1e-6 and abs(new_times.mean(metric) - request_s) < 1e-9:
            times, batch = new_times, new_batch
            break
        times, batch = new_times, new_batch
    encoder_busy = times.mean("encoder_busy_s")
    encoders = 0 if colocated or encoder_busy == 0 else max(1, math.ceil(throughput * encoder_busy / UTILISATION))
    return Load(mode, in_system, batch, count, encoders, throughput, times, stable)


def cache_break_even(times: MixTimes) -> float | None:
    """The hit rate above which the embedding cache saves time (None: it never does; see the module docstring)."""
    write, read = times.mean("cache_write_s"), times.mean("cache_read_s")
    saved = times.mean("encode_s") + write + times.mean("transfer_s") - read
    if saved <= write or saved <= 0:
        return None
    return write / saved


def no_cache_s(times: MixTimes) -> float:
    """The mix's disaggregated request time with no cache at all: every image encoded and pushed, nothing written."""
    return sum(
        s * (t.serving_s + t.encode_s + t.transfer_s + t.prefill_s + t.decode_s)
        for s, t in zip(times.shares, times.per_kind, strict=True)
    )
