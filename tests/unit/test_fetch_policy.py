"""The fetch policy without the network: the address classifier, URL parsing, the allowlist, validation."""

from __future__ import annotations

import ipaddress
import pickle

import pytest

from services.router.fetch import FetchError, FetchPolicy, classify_address
from services.router.fetch_policy import host_allowed, parse_target

ADDRESSES = [
    ("127.0.0.1", False),
    ("10.0.0.1", False),
    ("172.16.5.4", False),
    ("192.168.1.1", False),
    ("169.254.169.254", False),
    ("0.0.0.0", False),
    ("0.1.2.3", False),
    ("100.64.0.1", False),
    ("224.0.0.1", False),
    ("240.0.0.1", False),
    ("255.255.255.255", False),
    ("192.0.0.8", False),
    ("198.18.0.1", False),
    ("192.0.2.1", False),
    ("::", False),
    ("::1", False),
    ("fe80::1", False),
    ("fc00::1", False),
    ("fd12:3456::1", False),
    ("fec0::1", False),
    ("ff02::1", False),
    ("::ffff:10.0.0.1", False),
    ("::ffff:127.0.0.1", False),
    ("::ffff:93.184.216.34", False),
    ("::127.0.0.1", False),
    ("2002:7f00:1::1", False),
    ("2002:a00:1::1", False),
    ("64:ff9b::7f00:1", False),
    ("64:ff9b::a9fe:a9fe", False),
    ("64:ff9b:1::1", False),
    ("2001::1", False),
    ("2001:db8::1", False),
    ("93.184.216.34", True),
    ("8.8.8.8", True),
    ("1.1.1.1", True),
    ("2606:4700::1111", True),
    ("2a00:1450:4001:80b::200e", True),
    ("64:ff9b::5db8:d822", True),
    ("2002:5db8:d822::1", True),
]


@pytest.mark.parametrize(("address", "allowed"), ADDRESSES)
def test_address_classifier(address: str, allowed: bool) -> None:
    verdict = classify_address(ipaddress.ip_address(address))
    assert verdict.allowed is allowed, verdict.category


def test_classifier_names_categories() -> None:
    name = {
        a: classify_address(ipaddress.ip_address(a)).category
        for a in ("100.64.0.1", "224.0.0.1", "255.255.255.255", "fe80::1", "2002:7f00:1::1", "64:ff9b::a00:1")
    }
    assert name == {
        "100.64.0.1": "shared address space",
        "224.0.0.1": "multicast",
        "255.255.255.255": "broadcast",
        "fe80::1": "link-local",
        "2002:7f00:1::1": "6to4 embedding a loopback IPv4 address",
        "64:ff9b::a00:1": "NAT64 embedding a private IPv4 address",
    }


def test_parse_target_and_allowlist() -> None:
    target = parse_target("HTTPS://Img.Example.COM./a/b?x=1&y=%20#frag", FetchPolicy())
    assert (target.host, target.port, target.path, target.host_header) == (
        "img.example.com",
        443,
        "/a/b?x=1&y=%20",
        "img.example.com",
    )
    assert parse_target("https://h.example?q", FetchPolicy()).path == "/?q"
    assert parse_target("https://[2606:4700::1111]:8443", FetchPolicy()).host_header == "[2606:4700::1111]:8443"
    allow = frozenset({"cdn.example.com", "*.img.example.com"})
    assert [
        host_allowed(h, allow)
        for h in (
            "cdn.example.com",
            "a.img.example.com",
            "img.example.com",
            "evilimg.example.com",
            "cdn.example.com.evil",
        )
    ] == [True, True, False, False, False]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"allowed_schemes": ("ftp",)},
        {"allowed_schemes": ()},
        {"max_bytes": 0},
        {"total_timeout_s": -1},
        {"connect_timeout_s": 0},
        {"max_redirects": -1},
        {"allowed_hosts": frozenset({"*"})},
        {"allowed_hosts": frozenset({"Upper.example"})},
        {"allowed_hosts": frozenset({"a.*.example"})},
    ],
)
def test_policy_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="FetchPolicy"):
        FetchPolicy(**kwargs)  # type: ignore[arg-type]


def test_defaults_are_strict_and_error_pickles() -> None:
    policy = FetchPolicy()
    assert (policy.allowed_schemes, policy.max_redirects, policy.allow_loopback_for_tests) == (("https",), 0, False)
    error = pickle.loads(pickle.dumps(FetchError("no", "dns")))
    assert (str(error), error.reason) == ("no", "dns")
