"""HeldEmbeddings over a real EmbeddingPool: random admissions (an admitted request pins its items), look-ups,
hand-overs and ends never leave an admitted request without an embedding it was told the engine holds, nothing
is held twice, and what is kept stays within the budget."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.worker.engine.embeddings import EmbeddingPool
from services.worker.engine.host_device import HostDevice
from services.worker.held_embeddings import HeldEmbeddings

HASHES = ["a", "b", "c", "d", "e"]
ROWS = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 9}  # e is larger than the budget: handed over, never kept
BUDGET = 8 * 4 * 4  # bytes: eight rows of four float32


def embedding(mm_hash: str) -> torch.Tensor:
    return torch.full((ROWS[mm_hash], 4), float(ord(mm_hash)))


class InOrderEngine:
    """The engine's side as its commands reach it: in the order they were sent."""

    def __init__(self, pool: EmbeddingPool) -> None:
        self.pool = pool
        self.provided: list[str] = []

    def provide_embedding(self, mm_hash: str, tensor: torch.Tensor, keep: bool = False) -> None:
        self.provided.append(mm_hash)
        self.pool.provide(mm_hash, tensor, keep)

    def forget_embedding(self, mm_hash: str) -> None:
        self.pool.forget(mm_hash)


class HeldMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = EmbeddingPool(buffer_bytes=0, dtype=torch.float32, io=HostDevice(torch.device("cpu")))
        self.engine = InOrderEngine(self.pool)
        self.held = HeldEmbeddings(self.engine, BUDGET)
        self.live: dict[int, list[str]] = {}  # admitted requests' items
        self.waiting: dict[int, list[str]] = {}  # items each still waits for (fetched, not yet handed over)
        self.counter = 0

    @rule(items=st.lists(st.sampled_from(HASHES), min_size=1, max_size=3))
    def admit(self, items: list[str]) -> None:
        """As the worker: the engine admits (pins), then the items it does not hold are fetched."""
        self.counter += 1
        self.pool.acquire(items)
        self.live[self.counter] = items
        self.waiting[self.counter] = [h for h in dict.fromkeys(items) if not self.held.holds(h)]

    @precondition(lambda self: any(self.waiting.values()))
    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(r for r, items in self.waiting.items() if items)))
        mm_hash = self.waiting[request].pop(0)
        self.held.provide(mm_hash, embedding(mm_hash))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.release(self.live.pop(request))
        self.waiting.pop(request)

    @invariant()
    def admitted_requests_have_what_they_were_told_is_held(self) -> None:
        for request, items in self.live.items():
            for mm_hash in set(items) - set(self.waiting[request]):
                tensor = self.pool.peek(mm_hash)
                assert tensor is not None and tensor.shape[0] == ROWS[mm_hash]
                assert mm_hash in self.pool.pinned

    @invariant()
    def the_ledger_is_what_the_engine_keeps(self) -> None:
        ledger = {h for h in HASHES if h in self.held}
        assert self.pool.held == ledger
        assert set(self.pool.kept) <= ledger
        assert not set(self.pool.kept) & set(self.pool.pinned)
        assert sum(ROWS[h] * 16 for h in ledger) <= BUDGET
        assert not self.pool.buffered  # a zero buffer: nothing kept but what the ledger keeps

    @invariant()
    def nothing_unneeded_is_pinned(self) -> None:
        needed = {h for items in self.live.values() for h in items}
        assert set(self.pool.pinned) <= needed


TestHeldEmbeddings = HeldMachine.TestCase
TestHeldEmbeddings.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_a_held_embedding_is_not_handed_over_again_and_the_oldest_is_forgotten() -> None:
    pool = EmbeddingPool(buffer_bytes=0, dtype=torch.float32, io=HostDevice(torch.device("cpu")))
    engine = InOrderEngine(pool)
    held = HeldEmbeddings(engine, BUDGET)
    held.provide("a", embedding("a"))
    held.provide("a", embedding("a"))
    assert engine.provided == ["a"] and "a" in pool.kept
    held.provide("d", embedding("d"))
    held.provide("c", embedding("c"))  # 1 + 4 + 3 rows: at the budget
    assert held.holds("a")  # now the most recently used: b is not there, so d goes first
    held.provide("b", embedding("b"))
    assert not held.holds("d") and "d" not in pool.kept and pool.peek("d") is None
    held.provide("e", embedding("e"))  # larger than the budget: handed over, not kept
    assert not held.holds("e") and pool.peek("e") is None and engine.provided[-1] == "e"
