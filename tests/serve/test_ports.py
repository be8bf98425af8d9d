"""Free ports come from outside the ranges where Ray and the kernel hand out ports themselves."""

import random
import socket

import pytest

from ddtree_serve.serve import ports
from ddtree_serve.serve.ports import free_port, free_ports


def test_a_free_port_binds_and_lies_below_the_ephemeral_range() -> None:
    port = free_port()
    assert 20000 <= port <= min(29999, ports._ephemeral_start() - 1)
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder, socket.socket() as released:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        released.bind(("127.0.0.1", 0))
        vacant = released.getsockname()[1]
        released.close()
        monkeypatch.setattr(random, "sample", lambda population, k: [held, vacant])
        assert free_port() == vacant
        monkeypatch.setattr(random, "sample", lambda population, k: [held])
        with pytest.raises(OSError, match="no free TCP port"):
            free_port()


def test_a_lower_ephemeral_range_narrows_the_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 20010)
    assert {free_port() for _ in range(30)} <= set(range(20000, 20010))


def test_ports_drawn_together_are_distinct_and_too_few_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = free_ports(3)
    assert len(set(drawn)) == 3 and all(20000 <= port <= 29999 for port in drawn)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        monkeypatch.setattr(random, "sample", lambda population, k: [holder.getsockname()[1], drawn[0]])
        with pytest.raises(OSError, match=r"no free TCP port .*\(1 of the 2 asked for\)"):
            free_ports(2)
    with pytest.raises(ValueError, match="at least 1"):
        free_ports(0)
