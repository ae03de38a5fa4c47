"""The shared block hash: chained, media-aware, salted on block 0 only, stable across processes."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.block_hash import (
    ROOT_HASH,
    ExtraKey,
    block_extra_keys,
    extend_block_hashes,
    hash_block,
    prompt_block_hashes,
)
from services.models.media_span import MediaSpan

TOKENS = list(range(100, 164))  # 4 blocks of 16


def test_full_blocks_only_and_chained() -> None:
    hashes = prompt_block_hashes(TOKENS + [1, 2, 3], 16)
    assert len(hashes) == 4
    assert hashes[0] == hash_block(ROOT_HASH, TOKENS[:16], [])
    assert hashes[1] == hash_block(hashes[0], TOKENS[16:32], [])
    assert len(set(hashes)) == 4


def test_prefix_property() -> None:
    a = prompt_block_hashes(TOKENS, 16)
    b = prompt_block_hashes(TOKENS[:32] + [7] * 32, 16)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]


def test_extend_matches_whole() -> None:
    partial = prompt_block_hashes(TOKENS[:40], 16)
    assert extend_block_hashes(partial, TOKENS, 16) == prompt_block_hashes(TOKENS, 16)


def test_extra_keys_cover_every_overlapping_item() -> None:
    media = [MediaSpan("img-a", 10, 20), MediaSpan("img-b", 30, 4)]
    assert block_extra_keys(0, 16, media) == [ExtraKey("img-a", 0)]
    assert block_extra_keys(16, 32, media) == [ExtraKey("img-a", 6), ExtraKey("img-b", 0)]
    assert block_extra_keys(32, 48, media) == [ExtraKey("img-b", 2)]
    assert block_extra_keys(48, 64, media) == []


def test_different_image_changes_blocks_from_that_image_on() -> None:
    a = prompt_block_hashes(TOKENS, 16, [MediaSpan("img-a", 20, 8)])
    b = prompt_block_hashes(TOKENS, 16, [MediaSpan("img-b", 20, 8)])
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_cache_salt_changes_every_block() -> None:
    a = prompt_block_hashes(TOKENS, 16, cache_salt="tenant-a")
    b = prompt_block_hashes(TOKENS, 16, cache_salt="tenant-b")
    plain = prompt_block_hashes(TOKENS, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert all(x != y for x, y in zip(a, plain, strict=True))


def test_same_in_another_process() -> None:
    code = (
        "from services.common.block_hash import prompt_block_hashes;from services.models.media_span import MediaSpan;"
        "print(prompt_block_hashes(list(range(100,164)),16,[MediaSpan('m',3,5)],'s')[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == prompt_block_hashes(TOKENS, 16, [MediaSpan("m", 3, 5)], "s")[-1].hex()


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 3, 16, 64]),
    spans=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=3),
    salt=st.sampled_from(["", "tenant-a"]),
    done=st.integers(0, 5),
)
def test_every_hash_is_the_chain_of_hash_block(
    tokens: list[int], block_size: int, spans: list[tuple[int, int]], salt: str, done: int
) -> None:
    """The batched path (constants made once per call, blocks without media hashed inline) gives exactly the bytes of
    `hash_block` chained block by block, from scratch or extending a prefix already hashed."""
    media = [MediaSpan(f"m{i}", offset, length) for i, (offset, length) in enumerate(sorted(spans))]
    expected, parent = [], ROOT_HASH
    for index in range(len(tokens) // block_size):
        start, end = index * block_size, (index + 1) * block_size
        parent = hash_block(parent, tokens[start:end], block_extra_keys(start, end, media), salt if index == 0 else "")
        expected.append(parent)
    assert prompt_block_hashes(tokens, block_size, media, salt) == expected
    prefix = expected[: min(done, len(expected))]
    assert extend_block_hashes(list(prefix), tokens, block_size, media, salt) == expected
