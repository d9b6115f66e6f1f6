"""Ports chosen for a service bound later: free on the host and on every interface, outside the ephemeral range."""

from __future__ import annotations

import socket

import pytest

from jaxdist.controller import ports


def test_ports_are_distinct_free_everywhere_and_outside_the_range_outgoing_connections_use():
    low, high = ports._ephemeral_range()
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    for p in got:
        assert not low <= p <= high, (p, low, high)
        assert ports.port_is_free(p)


def _held(family: int, addr: str, v6only: bool = False) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
    s.bind((addr, 0))
    s.listen()
    return s


@pytest.mark.parametrize("where", ["loopback", "ipv4 wildcard", "ipv6 only wildcard"])
def test_a_port_held_where_the_coordinator_binds_is_not_free(where):
    if where == "ipv6 only wildcard" and not socket.has_ipv6:
        pytest.skip("this host has no IPv6")
    try:
        held = {
            "loopback": lambda: _held(socket.AF_INET, "127.0.0.1"),
            "ipv4 wildcard": lambda: _held(socket.AF_INET, "0.0.0.0"),
            "ipv6 only wildcard": lambda: _held(socket.AF_INET6, "::", v6only=True),
        }[where]()
    except OSError as e:
        pytest.skip(f"cannot bind {where} here: {e}")
    with held:
        port = held.getsockname()[1]
        assert not ports.port_is_free(port)  # an IPv6-only listener leaves 127.0.0.1 free: the old probe missed it


def test_without_room_outside_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(ports._binds(p, "127.0.0.1") for p in got)
