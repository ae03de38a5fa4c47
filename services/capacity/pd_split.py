"""`epd plan`'s prefill/decode split: which request kinds gain from a prefill pool, at which uncached-token threshold,
and the encoder : prefill : decode ratio.

Per request kind, from the cost model's times at the plan's batch (an encoder pool assumed, as the deployment's
times are): a co-located prefill of P prompt tokens runs among the decode steps of the worker's other sequences and
holds them for prefill(P) (chunked prefill spreads it over several steps but stretches them by as much in all); a
remote one holds no decode step and costs the request kv_transfer = transport(P x KV bytes per token) more time to
first token. The KV is costed with the profile's curve of the plan's transport (`epd profile` measures it on
embeddings, over the same ~1 MiB gRPC client-stream messages and the same gloo pairs a KV push uses:
`EPD_KV_TRANSPORT` grpc or dist).

A kind goes to the prefill pool when its prefill stalls decoding past what is allowed, and shipping its KV costs
less than computing it (else its time to first token would grow by more than the stall it saves anyone):

    stall      = prefill(P)                        what a decoding stream waits beside it
    allowed    = itl_ms - ITL                      with an inter-token target (`itl_ms` in the traffic file)
               = STALL_STEPS x ITL                 without one (a stall of more than that many tokens' gaps)
    remote     = stall > allowed and kv_transfer < prefill(P)

The threshold (EPD_PD_MIN_PREFILL_TOKENS) is the smallest prompt among the kinds sent: every smaller one is kept,
and a prefix-cache hit (not modelled here) only lowers a request's uncached count. Busy time per request, which sets
the pools' ratio: encoders (1 - h)(encode + cache write), as the deployment counts them; prefill workers the
share-weighted prefill of the kinds sent; decode workers decode / B plus the kept kinds' prefill; the ratio is
given with decode as 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.capacity import cost_model as cm
from services.capacity.profile import Profile

STALL_STEPS = 4.0
"""Without an inter-token target: a prefill holding decode for more than this many inter-token gaps is a stall."""

KV_TRANSPORTS = ("grpc", "gloo")  # the profile's transports a KV push can take (EPD_KV_TRANSPORT grpc, dist)


@dataclass(frozen=True)
class KindSplit:
    """One kind's verdict: its prompt, what its prefill costs where, and whether it goes to the prefill pool."""

    label: str
    share: float
    prompt_tokens: int
    prefill_s: float
    kv_transfer_s: float
    allowed_stall_s: float
    remote: bool


def split_kinds(
    kinds: tuple[cm.KindSizes, ...],
    load: cm.Load,
    profile: Profile,
    kv_bytes_per_token: int,
    transport: str,
    itl_ms: float | None,
) -> list[KindSplit]:
    """Each kind's verdict at ``load``'s batch (see the module docstring)."""
    out = []
    for kind, times in zip(kinds, load.times.per_kind, strict=True):
        transfer = profile.transfer_s(transport, kind.prompt_tokens * kv_bytes_per_token)
        itl = times.itl_s
        allowed = max(0.0, itl_ms / 1000 - itl) if itl_ms is not None else STALL_STEPS * itl
        remote = times.prefill_s > allowed and transfer < times.prefill_s
        out.append(KindSplit(kind.label, kind.share, kind.prompt_tokens, times.prefill_s, transfer, allowed, remote))
    return out


def pd_split_json(
    kinds: tuple[cm.KindSizes, ...],
    load: cm.Load,
    profile: Profile,
    kv_bytes_per_token: int,
    transport: str,
    itl_ms: float | None,
) -> dict[str, Any]:
    """`epd plan`'s `prefill_decode` section: the recommendation, its reasons, the threshold, per-kind verdicts and
    the encoder : prefill : decode ratio."""
    verdicts = split_kinds(kinds, load, profile, kv_bytes_per_token, transport, itl_ms)
    sent = [v for v in verdicts if v.remote]
    mean = load.times.mean
    decode_busy = mean("decode_s") / load.batch + sum(v.share * v.prefill_s for v in verdicts if not v.remote)
    prefill_busy = sum(v.share * v.prefill_s for v in sent)
    encoder_busy = mean("encoder_busy_s")
    limit = f"the {itl_ms:g} ms inter-token target" if itl_ms is not None else f"{STALL_STEPS:g} inter-token gaps"
    if sent:
        recommendation = "prefill pool"
        reasons = [
            f"{v.label}: its {v.prompt_tokens}-token prefill ({1000 * v.prefill_s:.1f} ms) would hold decoding "
            f"streams past {limit} (allowed {1000 * v.allowed_stall_s:.1f} ms); shipping its KV costs "
            f"{1000 * v.kv_transfer_s:.1f} ms"
            for v in sent
        ]
    else:
        recommendation = "co-located prefill"
        reasons = [
            "no kind's prefill holds decoding past " + limit + " while shipping its KV would cost less"
            if verdicts
            else "no request kinds"
        ]
    out: dict[str, Any] = {
        "recommendation": recommendation,
        "reasons": reasons,
        "threshold_tokens": min(v.prompt_tokens for v in sent) if sent else None,
        "transport": transport,
        "kinds": [
            {
                "label": v.label,
                "prompt_tokens": v.prompt_tokens,
                "prefill_s": v.prefill_s,
                "kv_transfer_s": v.kv_transfer_s,
                "allowed_stall_s": v.allowed_stall_s,
                "remote": v.remote,
            }
            for v in verdicts
        ],
        "ttft_cost_s": sum(v.share * v.kv_transfer_s for v in sent) / sum(v.share for v in sent) if sent else 0.0,
        "ratio": {
            "encoder": encoder_busy / decode_busy if decode_busy > 0 else None,
            "prefill": prefill_busy / decode_busy if decode_busy > 0 else None,
            "decode": 1.0,
        },
    }
    if transport not in KV_TRANSPORTS:
        out["note"] = (
            f"KV transfer over {transport} is not built (gRPC and gloo are): these are the times it would give"
        )
    return out
