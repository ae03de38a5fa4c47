"""Free ports for test and local clusters: bindable, below the kernel's ephemeral range, never the same one twice."""

from __future__ import annotations

import socket

import pytest

from services.launch import ports
from services.launch.ports import ephemeral_low, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """A cluster's plan draws a port per service: none may repeat (a port just closed is free again, and the
    kernel's ``bind(0)`` may answer it twice) and none may lie where outgoing connections take theirs."""
    drawn = [free_port() for _ in range(300)]
    assert len(set(drawn)) == len(drawn)
    assert all(ports.FLOOR <= port < ephemeral_low() for port in drawn)  # nor among Ray's worker ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", drawn[-1]))  # still free: nothing holds what was handed out


def test_a_port_in_use_is_skipped_and_a_spent_range_falls_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a range of 8 ports, one held by a listener: every other free one comes out once, never the held one,
    and then the kernel's choice (from the ephemeral range), still never a repeat."""
    monkeypatch.setattr(ports, "SPAN", 8)
    monkeypatch.setattr(ports, "FLOOR", 1024)
    low = ephemeral_low()
    window = range(low - 8, low)
    before = set(ports._handed_out)
    with socket.socket() as held:
        taken = next(p for p in window if ports._bindable("127.0.0.1", p))
        held.bind(("127.0.0.1", taken))
        held.listen()
        available = {p for p in window if p not in before and ports._bindable("127.0.0.1", p)}
        drawn = [free_port() for _ in range(len(window))]
    assert taken not in drawn and len(set(drawn)) == len(drawn) and not before & set(drawn)
    assert {p for p in drawn if p < low} == available  # each free port of the window, once
    assert all(p >= low for p in drawn if p not in available)  # then the kernel's
