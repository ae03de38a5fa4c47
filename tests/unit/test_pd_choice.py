"""The router's remote-prefill choice: below the uncached-token threshold never, at or above it always while a
paired prefill worker has room; a prompt whose prefix the decode worker caches counts only its uncached part."""

from __future__ import annotations

import dataclasses

import pytest

from services.common import config as config_lib
from services.common.config import ConfigError
from services.common.kv_layout import KVLayout
from services.router.cluster_view import WorkerView
from services.router.config import RouterConfig
from services.router.pd_choice import PrefillPolicy, choose_prefill, uncached_tokens

LAYOUT = KVLayout("rev", "float32", 2, 2, 16, 16, "head-major")


def view(address: str, role: str, waiting: int = 0, reserved: int = 0, layout: KVLayout | None = LAYOUT) -> WorkerView:
    return WorkerView(address, 100, 100, reserved, 0, waiting, 16, worker_role=role, kv_layout=layout)


DECODE = view("d", "decode")
POLICY = PrefillPolicy(min_prefill_tokens=256, max_prefill_waiting=2)


def test_threshold_counts_uncached_tokens_only() -> None:
    prefill = [view("p", "prefill")]
    assert choose_prefill(POLICY, DECODE, 255, 0, prefill) is None
    assert choose_prefill(POLICY, DECODE, 256, 0, prefill) == prefill[0]
    assert choose_prefill(POLICY, DECODE, 1000, 0, prefill) == prefill[0]
    assert uncached_tokens(1000, 50, 16) == 200
    assert choose_prefill(POLICY, DECODE, 1000, 50, prefill) is None  # 800 tokens cached on the decode worker
    assert uncached_tokens(32, 2, 16) == 1


def test_only_decode_workers_with_a_paired_prefill_worker_with_room() -> None:
    busy, full = view("busy", "prefill", waiting=2), view("full", "prefill", reserved=95)
    other = view("other", "prefill", layout=dataclasses.replace(LAYOUT, block_size=32))
    assert choose_prefill(POLICY, DECODE, 1000, 0, [busy, full, other]) is None  # queue bound, blocks, identity
    idle, less = view("idle", "prefill"), view("less", "prefill", waiting=1)
    assert choose_prefill(POLICY, DECODE, 1000, 0, [less, busy, idle]) == idle  # the least loaded
    assert choose_prefill(POLICY, view("b", "both"), 1000, 0, [idle]) is None  # a `both` worker prefills itself
    assert choose_prefill(POLICY, DECODE, 1000, 0, [idle], transferable=False) is None  # n > 1, a grammar
    assert choose_prefill(PrefillPolicy(), DECODE, 10_000, 0, [idle]) is None  # off by default


def test_settings() -> None:
    config = config_lib.load(
        RouterConfig, env={"EPD_MODEL": "/m", "EPD_PD_MIN_PREFILL_TOKENS": "512", "EPD_PD_MAX_PREFILL_WAITING": "3"}
    )
    assert (config.pd_min_prefill_tokens, config.pd_max_prefill_waiting) == (512, 3)
    with pytest.raises(ConfigError, match="EPD_PD_MIN_PREFILL_TOKENS"):
        config_lib.load(RouterConfig, env={"EPD_MODEL": "/m", "EPD_PD_MIN_PREFILL_TOKENS": "-1"}).validate()
