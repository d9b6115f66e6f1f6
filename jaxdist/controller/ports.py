"""Picking TCP ports for a service another process will bind later (the coordinator of a generation, a test's
cluster): free on the given host and on every interface, and outside the kernel's range for outgoing
connections' local ports, which a busy host hands out by the thousand between the choice and its use."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default where unknown)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _binds(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if ``port`` can be bound now on ``host`` and on the wildcard address (JAX's coordination service
    binds ``[::]``, dual-stack where the host has IPv6, else ``0.0.0.0``)."""
    if not _binds(port, host):
        return False
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this host
        return _binds(port, "0.0.0.0")
    with s:
        try:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free right now (:func:`port_is_free`), picked at random below (or above) the
    kernel's ephemeral range, so that no outgoing connection's local port takes one between now and its use;
    another program choosing ports the same way may still take one (a chance of about n in 20,000)."""
    low, high = _ephemeral_range()
    spans = [r for r in (range(max(1024, low - 20000), low), range(high + 1, 65536)) if len(r) >= 1000]
    rng, ports = random.SystemRandom(), []
    for _ in range(200 * n if spans else 0):
        port = rng.choice(max(spans, key=len))
        if port not in ports and port_is_free(port, host):
            ports.append(port)
            if len(ports) == n:
                return ports
    while len(ports) < n:  # no room outside the ephemeral range, or all of it taken: ask the kernel
        with socket.socket() as s:
            s.bind((host, 0))
            if s.getsockname()[1] not in ports:
                ports.append(s.getsockname()[1])
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` and on every interface (see :func:`free_ports`)."""
    return free_ports(1, host)[0]
