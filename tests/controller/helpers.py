"""Helpers of the controller tests."""

from __future__ import annotations

import os
import stat
from pathlib import Path

# A process that keeps one core busy until its parent is gone: a test killed mid-way (a CI timeout, a SIGKILL of its
# pytest worker) must not leave it loading the host for every later test.
BUSY_LOOP = (
    "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100_000):\n        pass\n"
)


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


def fake_ssh(bindir: Path) -> None:
    """An `ssh` that runs the remote command here (options skipped, stdin passed through): a "remote"
    host whose address is 127.0.0.1."""
    f = bindir / "ssh"
    f.write_text(
        "#!/bin/bash\n"
        'while [[ "$1" == -* ]]; do case "$1" in -o|-R|-L|-p|-i) shift 2;; *) shift;; esac; done\n'
        'host="$1"; shift; cmd="$*"\nexec bash -c "${cmd//--host $host/--host 127.0.0.1}"\n'
    )
    f.chmod(f.stat().st_mode | stat.S_IEXEC)
