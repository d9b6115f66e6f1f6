"""Helpers of the controller tests."""

from __future__ import annotations

import os
from pathlib import Path


def listening(pid: int) -> list[str]:
    """host:port of every TCP socket ``pid`` listens on (from /proc; IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                addr, port = f[1].split(":")
                host = (
                    "127.0.0.1"
                    if addr in ("0100007F", "0000000000000000FFFF00000100007F")  # also v4-mapped
                    else "0.0.0.0"
                    if addr == "00000000"
                    else "::1"
                    if addr == "0" * 24 + "01000000"
                    else addr
                )
                out.append(f"{host}:{int(port, 16)}")
    return out
