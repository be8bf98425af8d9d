"""Free TCP ports that neither the kernel nor Ray will hand to someone else a moment later.

A port found by binding port 0 comes from the kernel's ephemeral range, which is where Ray's own
components land too: its dashboard agent listens on 52365 by default and its raylet, GCS and
object manager bind further ephemeral ports while a cluster starts. A port probed there and
released can be taken before Serve's proxy binds it (CI failed once on exactly 52365). So ports
are drawn from 20000-29999: above Ray's worker range (10002-19999), below the HTTP ports Serve's
direct ingress gives its replicas (30000-31000, `--serve-throughput-optimized`), below Linux's
default ephemeral range (32768-60999; a host that starts it lower narrows the draw to below its
start) and macOS's (49152-65535), and clear of every port Ray or Serve binds by default.
"""

import random
import socket
from pathlib import Path

_FIRST, _LAST = 20000, 29999
_ATTEMPTS = 200
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port in 20000-29999, below the kernel's ephemeral range, that `host` can bind now
    (chosen at random, so callers racing each other rarely meet)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports as `free_port` draws them, from one random draw (so one server's
    HTTP, gRPC and metrics ports are never the same port, as two separate draws can be)."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    last = min(_LAST, _ephemeral_start() - 1)
    candidates = range(_FIRST, last + 1)
    drawn: list[int] = []
    for port in random.sample(candidates, min(_ATTEMPTS, len(candidates))):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        drawn.append(port)
        if len(drawn) == count:
            return drawn
    raise OSError(
        f"no free TCP port on {host or 'any address'} in {_FIRST}-{last} "
        f"({len(drawn)} of the {count} asked for)"
    )


def _ephemeral_start() -> int:
    """The first port of Linux's ephemeral range (its default where the file is absent)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
