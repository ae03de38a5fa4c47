"""Free TCP ports for services started on this machine: below the kernel's ephemeral range, none handed out twice.

Why not ``bind(0)``: the kernel answers with a port of its ephemeral range, the range every outgoing connection
takes its local port from, so between choosing a port and the service binding it (seconds: a service imports
torch first) a connection to Redis or to another service could take it; and a port just closed can be answered
again, so two services of one plan could get the same one. A CI run lost a test cluster to ``Address already in
use`` at an encoder's metrics port (which of the two, its log does not say). Ports here come from just below
that range (above Ray's worker ports), at random, each checked bindable and never returned twice by this process.
"""

from __future__ import annotations

import random
import socket

SPAN = 16_000
"""How many ports below the ephemeral range are drawn from (never below `FLOOR`)."""
FLOOR = 20_000
"""Ray's worker processes take ports 10002-19999 by default (tests/deploy start a Ray cluster): never drawn."""

_handed_out: set[int] = set()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now that this process has not handed out before (see the module docstring)."""
    high = ephemeral_low()
    low = max(FLOOR, high - SPAN)
    for _ in range(1000 if low < high else 0):
        port = random.randrange(low, high)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    while True:  # everything drawn was taken: the kernel's choice, still never one handed out before
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
