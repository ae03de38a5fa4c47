"""`epd plan`'s report: sizes from the model folder, times and a deployment from a profile, as JSON.

Without a profile the report holds the sizes only (tokens per item, KV bytes per token, embedding against KV
bytes) and says that times need one; nothing is guessed. With one it adds the cost model's times
(`cost_model.py`), the recommended deployment (co-located or an encoder pool, with the encoder:worker ratio),
KV per worker, the hit rate at which the embedding cache pays, and whether a prefill pool pays (pd_split.py: the
uncached-token threshold and the encoder : prefill : decode ratio).

Deployment rule: run the encoder co-located when that is no slower on average (no transfer, but the tower
stretches the worker's decode steps), every pool stays stable, and the co-located worst inter-token latency
(a decode step plus one request's encode) meets `itl_ms` when given; otherwise an encoder pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.capacity import cost_model as cm
from services.capacity.model_sizes import ModelSizes
from services.capacity.pd_split import pd_split_json
from services.capacity.profile import Profile
from services.capacity.traffic import Traffic

MIB = 1 << 20


@dataclass(frozen=True)
class Plan:
    """Everything `epd plan` reports; `disaggregated` / `colocated` are None without a profile."""

    sizes: ModelSizes
    traffic: Traffic
    kinds: tuple[cm.KindSizes, ...]
    profile: Profile | None
    transport: str
    disaggregated: cm.Load | None
    colocated: cm.Load | None

    @property
    def recommendation(self) -> tuple[str, list[str]] | None:
        """("co-located" | "disaggregated", reasons), or None without a profile."""
        if self.disaggregated is None or self.colocated is None:
            return None
        dis, co = self.disaggregated, self.colocated
        reasons = []
        if not co.stable:
            reasons.append("co-located workers could not keep up (the tower takes too much of their time)")
        elif co.request_s > dis.request_s:
            reasons.append(
                f"co-located requests take {1000 * co.request_s:.1f} ms against {1000 * dis.request_s:.1f} ms "
                "with an encoder pool (the tower stretches the worker's decode steps more than a transfer costs)"
            )
        worst_itl = colocated_worst_itl_s(co)
        if self.traffic.itl_ms is not None and worst_itl * 1000 > self.traffic.itl_ms:
            reasons.append(
                f"a co-located encode holds decoding sequences for up to {1000 * worst_itl:.1f} ms, over the "
                f"{self.traffic.itl_ms:g} ms inter-token target"
            )
        if reasons:
            return "disaggregated", reasons
        if not any(k.media_items for k in self.kinds):
            return "co-located", ["no request carries an image or a video: an encoder pool would sit idle"]
        return "co-located", [
            f"co-located requests take {1000 * co.request_s:.1f} ms against {1000 * dis.request_s:.1f} ms with an "
            "encoder pool (no transfer), and the targets hold"
        ]


def colocated_worst_itl_s(load: cm.Load) -> float:
    """A co-located worker's worst inter-token gap: a decode step plus the longest one request's encode."""
    return max(t.itl_s + t.encode_s + t.cache_write_s for t in load.times.per_kind)


def make_plan(sizes: ModelSizes, traffic: Traffic, profile: Profile | None, transport: str = "grpc") -> Plan:
    """The plan for `traffic` on the model `sizes` describes; raises TrafficError for what it cannot count."""
    kinds = tuple(cm.kind_sizes(sizes, kind, i) for i, kind in enumerate(traffic.requests))
    dis = co = None
    if profile is not None:
        model = cm.CostModel(sizes, profile, transport)
        dis = cm.solve_load(model, list(kinds), traffic, "disaggregated")
        co = cm.solve_load(model, list(kinds), traffic, "co-located")
    return Plan(sizes, traffic, kinds, profile, transport, dis, co)


def plan_json(plan: Plan) -> dict[str, Any]:
    """The report as one JSON-able dict (sizes always; times, deployment and cache with a profile)."""
    s = plan.sizes
    out: dict[str, Any] = {
        "model": {
            "dir": str(s.model_dir),
            "model_type": s.model_type,
            "dtype": s.dtype,
            "layers": s.num_layers,
            "kv_heads": s.kv_heads,
            "head_dim": s.head_dim,
            "hidden_size": s.hidden_size,
            "embedding_width": s.embedding_width,
        },
        "kv_bytes_per_token": s.kv_bytes_per_token,
        "embedding_bytes_per_token": s.embedding_bytes_per_token,
        "requests": [_kind_json(plan, i) for i in range(len(plan.kinds))],
        "traffic": {
            "reuse": plan.traffic.reuse,
            "rate": plan.traffic.rate,
            "concurrency": plan.traffic.clients or None,
            "ttft_ms": plan.traffic.ttft_ms,
            "itl_ms": plan.traffic.itl_ms,
        },
        "times": None,
        "deployment": None,
        "cache": None,
        "prefill_decode": None,
        "profile": None,
    }
    if plan.disaggregated is None or plan.colocated is None or plan.profile is None:
        out["note"] = "times need a profile of this model on the target hardware: epd profile --model DIR"
        return out
    dis, co = plan.disaggregated, plan.colocated
    times = dis.times
    out["times"] = {
        "encode_s": times.mean("encode_s"),
        "cache_write_s": times.mean("cache_write_s"),
        "transfer_s": times.mean("transfer_s"),
        "prefill_s": times.mean("prefill_s"),
        "decode_s": times.mean("decode_s"),
        "serving_s": times.mean("serving_s"),
        "request_s_disaggregated": dis.request_s,
        "request_s_colocated": co.request_s,
        "ttft_s": times.mean("ttft_s"),
        "itl_s": times.mean("itl_s"),
    }
    mode, reasons = plan.recommendation or ("disaggregated", [])
    chosen = dis if mode == "disaggregated" else co
    mean_tokens = sum(k.share * (k.prompt_tokens + k.output_tokens) for k in plan.kinds)
    worker_busy = times.mean("prefill_s") + times.mean("decode_s") / dis.batch
    out["deployment"] = {
        "recommendation": mode,
        "reasons": reasons,
        "workers": chosen.workers,
        "encoders": chosen.encoders,
        "encoder_worker_ratio": times.mean("encoder_busy_s") / worker_busy if worker_busy > 0 else None,
        "batch_per_worker": chosen.batch,
        "requests_in_system": chosen.in_system,
        "request_rate": chosen.rate,
        "stable": chosen.stable,
        "kv_bytes_per_worker": chosen.batch * mean_tokens * s.kv_bytes_per_token,
        "colocated_worst_itl_s": colocated_worst_itl_s(co),
        "targets": _targets(plan, chosen),
    }
    break_even = cm.cache_break_even(times)
    out["cache"] = {
        "reuse": plan.traffic.reuse,
        "break_even_hit_rate": break_even,
        "pays": break_even is not None and plan.traffic.reuse > break_even,
        "request_s_without_cache": cm.no_cache_s(times),
    }
    out["prefill_decode"] = pd_split_json(
        plan.kinds, dis, plan.profile, s.kv_bytes_per_token, plan.transport, plan.traffic.itl_ms
    )
    measured = plan.profile.model
    if measured.get("model_type") != s.model_type or measured.get("hidden_size") != s.hidden_size:
        out["warnings"] = [
            f"the profile was measured on a {measured.get('model_type')} model of hidden size "
            f"{measured.get('hidden_size')} ({measured.get('dir')}), not this {s.model_type} of hidden size "
            f"{s.hidden_size}: its times are another model's"
        ]
    out["profile"] = {
        "model": plan.profile.model,
        "hardware": plan.profile.hardware,
        "dtype": plan.profile.dtype,
        "transport": plan.transport,
    }
    return out


def _kind_json(plan: Plan, index: int) -> dict[str, Any]:
    kind = plan.kinds[index]
    kv_per_token = plan.sizes.kv_bytes_per_token
    row: dict[str, Any] = {
        "label": kind.label,
        "share": kind.share,
        "images": [
            {
                "size": f"{i.width}x{i.height}",
                "tokens": i.tokens,
                "tokens_uncapped": i.tokens_uncapped,
                "resized": f"{i.resized_width}x{i.resized_height}",
                "embedding_bytes": i.embedding_bytes,
                "kv_bytes": i.kv_bytes,
                "embedding_bytes_uncapped": i.embedding_bytes_uncapped,
                "kv_bytes_uncapped": i.kv_bytes_uncapped,
            }
            for i in kind.images
        ],
        "videos": [
            {
                "size": f"{v.width}x{v.height}",
                "seconds": v.seconds,
                "fps": v.fps,
                "frames": v.frames,
                "tokens": v.tokens,
                "resized": f"{v.resized_width}x{v.resized_height}",
                "embedding_bytes": v.embedding_bytes,
                "kv_bytes": v.kv_bytes,
            }
            for v in kind.videos
        ],
        "text_tokens": kind.text_tokens,
        "image_tokens": kind.image_tokens,
        "video_tokens": kind.video_tokens,
        "image_tokens_uncapped": kind.image_tokens_uncapped,
        "prompt_tokens": kind.prompt_tokens,
        "output_tokens": kind.output_tokens,
        "embedding_bytes": kind.embedding_bytes,
        "kv_bytes": (kind.prompt_tokens + kind.output_tokens) * kv_per_token,
        "image_kv_bytes": kind.image_tokens * kv_per_token,
        "video_kv_bytes": kind.video_tokens * kv_per_token,
    }
    if plan.disaggregated is not None and plan.colocated is not None:
        t, c = plan.disaggregated.times.per_kind[index], plan.colocated.times.per_kind[index]
        row["times"] = {
            "encode_s": t.encode_s,
            "cache_write_s": t.cache_write_s,
            "cache_read_s": t.cache_read_s,
            "transfer_s": t.transfer_s,
            "prefill_s": t.prefill_s,
            "decode_s": t.decode_s,
            "serving_s": t.serving_s,
            "ttft_s": t.ttft_s,
            "itl_s": t.itl_s,
            "request_s_disaggregated": t.disaggregated_s,
            "request_s_colocated": c.colocated_s,
        }
    return row


def _targets(plan: Plan, load: cm.Load) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    predicted = {"ttft_ms": 1000 * load.times.mean("ttft_s"), "itl_ms": 1000 * load.times.mean("itl_s")}
    for name, value in predicted.items():
        target = getattr(plan.traffic, name)
        targets[name] = {"target": target, "predicted": value, "met": None if target is None else value <= target}
    return targets
