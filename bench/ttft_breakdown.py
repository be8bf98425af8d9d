"""Where a served request's time to first token goes: Serve's hops against the model's work.

Starts the application (one speculation group, its spans to a JSON-lines file), sends
`--requests` streaming HTTP completions one after another, and sets each request's spans against
the client's clock (one host, one clock): the client's send to the ingress's request span, the
ingress to the Coordinator's request span, the Coordinator to the prefill phase, the prefill
itself (the target's call, the actor hop included), and the prefill's end to the client's first
byte (the first chunk's way back through the Coordinator's stream, the ingress and the proxy).
Milliseconds, medians over the requests after the first (which meets cold code paths).

    python bench/ttft_breakdown.py                                   # CPU, actor calls
    python bench/ttft_breakdown.py --device cuda --dtype bfloat16 --transport compiled_graph

On the CI CPU (eleventh session) ~16 of the 19 ms a served first token costs over the engine
in process were Serve's ingress hops, not the split into actors.
"""

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import deploy, start_cluster, stop_application

from ddtree_serve.config import EngineConfig
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.launcher import direct_ingress_ports
from ddtree_serve.serve.ports import free_port

PARTS = (
    "client -> ingress",
    "ingress -> Coordinator",
    "Coordinator -> prefill",
    "prefill",
    "prefill end -> first byte",
    "TTFT",
)


def send(client: httpx.Client, url: str, max_tokens: int) -> tuple[float, float]:
    """One streaming completion: (send time, first data line time), wall clock seconds. One
    client for all of them: a new one per request costs tens of milliseconds of its own."""
    body = {"model": "ddtree-bundled", "prompt": "import os\nimport sys\n", "max_tokens": max_tokens}
    sent = time.time()
    first = None
    with client.stream("POST", url, json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.time()
    if first is None:
        raise RuntimeError("the stream sent no data")
    return sent, first


def breakdown(spans: list[dict], sent: float, first: float) -> list[float] | None:
    """The request's parts (ms, in `PARTS` order) from its trace's spans, or None when the
    spans nearest its send time do not form one trace (a request whose spans are missing)."""
    traces: dict[str, list[dict]] = {}
    for span in spans:
        traces.setdefault(span["context"]["trace_id"], []).append(span)

    def start(span: dict) -> float:
        return _seconds(span["start_time"])

    candidates = []
    for trace in traces.values():
        ingress = [s for s in trace if s["resource"]["attributes"].get("ddtree.component") == "ingress"]
        request = [s for s in trace if s["name"] == "ddtree.request"]
        prefill = [s for s in trace if s["name"] == "prefill"]
        if ingress and request and prefill:
            candidates.append((abs(start(ingress[0]) - sent), ingress[0], request[0], prefill[0]))
    if not candidates:
        return None
    _, ingress, request, prefill = min(candidates, key=lambda c: c[0])
    marks = [sent, start(ingress), start(request), start(prefill), _seconds(prefill["end_time"]), first]
    parts = [1000.0 * (later - earlier) for earlier, later in itertools.pairwise(marks)]
    return [*parts, 1000.0 * (first - sent)]


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    span_file = Path(tempfile.mkdtemp(prefix="ddtree-ttft-")) / "spans.jsonl"
    gpu_share = 0.5 if args.device.startswith("cuda") else 0.0
    config = ServeConfig(
        app_name="ttft",
        engine=EngineConfig(device=args.device, dtype=args.dtype, max_seq_len=512),
        observability={"metrics": False, "tracing": {"exporter": "file", "file_path": str(span_file)}},  # type: ignore[arg-type]
        placement={  # type: ignore[arg-type]
            "transport": args.transport,
            "coordinator": {"num_cpus": 0.1},
            "drafter": {"num_cpus": 0.1, "num_gpus": gpu_share},
            "target": {"num_cpus": 0.1, "num_gpus": gpu_share},
        },
        ingress={"num_cpus": 0.1},  # type: ignore[arg-type]
        stream_batching_interval_ms=0.0,  # a chunk per step, as the earlier tables ran
        http={"port": free_port()},  # type: ignore[arg-type]
        grpc={"port": free_port()},  # type: ignore[arg-type]
    )
    ray_dir = tempfile.mkdtemp(prefix="ddtree-bench-")
    start_cluster(config, ray_dir, args.serve_throughput_optimized)
    try:
        deploy(config)
        port = direct_ingress_ports("ttft")["http"] if args.direct_ingress else config.http.port
        url = f"http://127.0.0.1:{port}/ttft/v1/completions"
        timings = []
        with httpx.Client(timeout=60.0) as client:
            for _ in range(args.requests):
                timings.append(send(client, url, args.max_tokens))
                time.sleep(args.gap_s)
        time.sleep(2.0)  # the span processors' batches reach the file
    finally:
        stop_application(ray_dir)
    spans = [json.loads(line) for line in span_file.read_text().splitlines() if line.strip()]
    rows = [parts for sent, first in timings[1:] if (parts := breakdown(spans, sent, first)) is not None]
    if not rows:
        raise SystemExit(f"no request's spans found in {span_file}")
    print(f"\n{len(rows)} requests, transport {args.transport}, {args.device}; ms, median (min - max):\n")
    for name, values in zip(PARTS, zip(*rows, strict=True), strict=True):
        print(f"  {name:<26} {statistics.median(values):7.1f}  ({min(values):.1f} - {max(values):.1f})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--transport", default="actor_calls", choices=["actor_calls", "compiled_graph", "sockets"]
    )
    parser.add_argument("--requests", type=int, default=12, help="sequential streaming requests")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gap-s", type=float, default=0.2, help="pause between requests")
    parser.add_argument(
        "--serve-throughput-optimized",
        action="store_true",
        help="the cluster in Ray Serve's throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1)",
    )
    parser.add_argument(
        "--direct-ingress",
        action="store_true",
        help="send to the ingress replica's own HTTP server (needs --serve-throughput-optimized), "
        "not the proxy",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
