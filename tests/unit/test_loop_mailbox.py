"""LoopMailbox: values posted from another thread arrive on the loop in order, with one wake-up per batch."""

from __future__ import annotations

import asyncio
import threading

from services.common.loop_mailbox import LoopMailbox


def test_posts_from_a_thread_arrive_in_order_and_share_wake_ups() -> None:
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        original = loop.call_soon_threadsafe

        def counting(*args: object) -> asyncio.Handle:
            nonlocal wake_ups
            wake_ups += 1
            return original(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        mailbox = LoopMailbox(loop)
        received: list[int] = []
        done = asyncio.Event()

        def take(value: int) -> None:
            received.append(value)
            if value == 999:
                done.set()

        def produce() -> None:
            for i in range(1000):  # the loop is blocked below, so these pile up behind one wake-up
                mailbox.post(take, i)

        thread = threading.Thread(target=produce)
        thread.start()
        thread.join()  # blocks the loop: nothing is delivered while the producer runs
        await asyncio.wait_for(done.wait(), 5)
        return received, wake_ups

    received, wake_ups = asyncio.run(main())
    assert received == list(range(1000))
    assert wake_ups == 1


def test_a_post_after_delivery_wakes_the_loop_again() -> None:
    async def main() -> list[str]:
        mailbox = LoopMailbox(asyncio.get_running_loop())
        received: list[str] = []
        for value in ("a", "b"):
            arrived = asyncio.Event()

            def take(v: str, e: asyncio.Event = arrived) -> None:
                received.append(v)
                e.set()

            threading.Thread(target=mailbox.post, args=(take, value)).start()
            await asyncio.wait_for(arrived.wait(), 5)
        return received

    assert asyncio.run(main()) == ["a", "b"]
