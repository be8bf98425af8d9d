"""One step-socket round trip by payload, over loopback TCP against the abstract Unix socket.

The socket step graph (`serve/step_sockets.py`) sends every draft and delivery as one framed
message between two processes of a node. This echoes messages of a draft's shape (top-K log-probs
and ids, [batch, block - 1, K], as `to_wire` leaves them: numpy arrays sent out of band) between
this process and a child, with the graph's own `connect`, `send_message` and `recv_message`, and
prints the median round trip per family and batch size: the floor under each hop the
`hop_breakdown.py` step tables show.

    python bench/step_socket_rtt.py --batch-sizes 1 16 64 --repeats 500
"""

import argparse
import multiprocessing
import os
import socket
import statistics
import threading
import time

import numpy as np

from ddtree_serve.serve.graph_calls import DrafterCall
from ddtree_serve.serve.step_sockets import (
    STEP_SOCKET_FAMILY_VARIABLE,
    ChannelAddress,
    DrafterChannelServer,
    connect,
    recv_message,
    send_message,
)

BLOCK_LEVELS = 15
"""Draft positions per block past the root (the bundled drafter's block of 16)."""


def _serve(addresses: "multiprocessing.Queue[ChannelAddress]") -> None:
    """A drafter step server whose draft echoes the call's inputs."""
    lock = threading.Lock()
    server = DrafterChannelServer(lambda call: None if call is None else call.inputs, _no_take, lock, True)
    addresses.put(server.address)
    threading.Event().wait()


def _no_take(delivery: object, call: object) -> None:
    return None


def draft_payload(batch_size: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(batch_size)
    logp = rng.standard_normal((batch_size, BLOCK_LEVELS, top_k)).astype(np.float32)
    ids = rng.integers(0, 1 << 17, size=(batch_size, BLOCK_LEVELS, top_k), dtype=np.int64)
    return logp, ids


def round_trip_us(address: ChannelAddress, family: str, payload: object, repeats: int) -> float:
    """Median microseconds of one message there and its echo back, after a warm-up."""
    os.environ[STEP_SOCKET_FAMILY_VARIABLE] = family
    sock = connect(address, b"C")
    expected = socket.AF_UNIX if family == "auto" and address.unix_name else socket.AF_INET
    assert sock.family == expected, f"{family}: connected over {sock.family!r}"
    call = DrafterCall((), payload)
    samples = []
    for index in range(repeats + repeats // 10):
        start = time.perf_counter()
        send_message(sock, (index, index, call, False, True))
        recv_message(sock)
        samples.append(time.perf_counter() - start)
    sock.close()
    return 1e6 * statistics.median(samples[repeats // 10 :])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--top-k", type=int, default=32, help="draft top-K (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=500, help="timed round trips (default: %(default)s)")
    args = parser.parse_args(argv)
    spawn = multiprocessing.get_context("spawn")
    rows = []
    for batch_size in args.batch_sizes:
        payload = draft_payload(batch_size, args.top_k)
        nbytes = sum(array.nbytes for array in payload)
        figures = {}
        for family in ("tcp", "auto"):
            # A server per connection: a step server's channel ends when its peer leaves.
            addresses: multiprocessing.Queue[ChannelAddress] = spawn.Queue()
            child = spawn.Process(target=_serve, args=(addresses,), daemon=True)
            child.start()
            figures[family] = round_trip_us(addresses.get(timeout=60), family, payload, args.repeats)
            child.kill()
        rows.append((batch_size, nbytes, figures["tcp"], figures["auto"]))
        print(
            f"batch {batch_size}: {nbytes} B, tcp {figures['tcp']:.1f} us, unix {figures['auto']:.1f} us",
            flush=True,
        )
    print("\n| batch | draft bytes | TCP round trip, us | Unix round trip, us | Unix / TCP |")
    print("|---|---|---|---|---|")
    for batch_size, nbytes, tcp, unix in rows:
        print(f"| {batch_size} | {nbytes} | {tcp:.1f} | {unix:.1f} | {unix / tcp:.2f} |")


if __name__ == "__main__":
    main()
