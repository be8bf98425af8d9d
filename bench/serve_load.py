"""Load test of the served application against the same engine in process.

Starts a local Ray cluster with the application (one speculation group), then at each
concurrency level runs a closed loop of streaming requests over HTTP (SSE) and gRPC
(server streaming), and the same load against `AsyncLLM` over an in-process engine built from
the same `EngineConfig`. Prints time to first token, time per output token, output throughput
and the served / in-process throughput ratio.

    python bench/serve_load.py                                   # bundled pair
    python bench/serve_load.py --target DIR --drafter DIR --concurrency 1 4 16 --max-tokens 64
    python bench/serve_load.py --device cuda --dtype bfloat16      # both actors on one GPU (0.5 each)
    python bench/serve_load.py --transport actor_calls compiled_graph --overlap off on
    python bench/serve_load.py --stream-batching-interval-ms 0 50

Each (transport, overlap, chained drafts, stream interval) is its own application (speculation
group) under its own route prefix and gRPC application name, deployed in turn on the one
cluster; `--repeats` sweeps interleave them, with the in-process engine measured next to each.

Every request uses greedy decoding with `ignore_eos`, so all of them generate exactly
`--max-tokens` tokens and the three paths do the same work. On a small CPU machine the Ray
processes (proxy, ingress, coordinator, workers) share the cores with the load generator;
the ratio is what serving costs there, not a property of the algorithm.
"""

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import get_args

import grpc
import httpx
import torch

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.async_llm import AsyncLLM
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.serve.config import PlacementWorkers, ServeConfig
from ddtree_serve.serve.launcher import direct_ingress_ports
from ddtree_serve.serve.ports import free_ports

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np\n",
    "for i in range(10):",
    "class Stack:\n    def __init__(self):",
    "Once upon a time",
]


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float  # request sent -> first streamed tokens
    total_s: float  # request sent -> last chunk
    num_tokens: int

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first chunk."""
        return (self.total_s - self.ttft_s) / max(self.num_tokens - 1, 1)


@dataclass(frozen=True)
class LevelResult:
    path: str
    concurrency: int
    timings: list[RequestTiming]
    wall_s: float
    engine_steps: int  # steps the path's engine ran during the level
    engine_step_s: float  # their wall time, in the engine's thread
    client_cpu_s: float  # CPU time of the load generator's processes (in process: the engine's too)

    @property
    def engine_ms_per_step(self) -> float:
        return 1e3 * self.engine_step_s / max(self.engine_steps, 1)

    @property
    def engine_busy(self) -> float:
        """Share of the level's wall time the engine spent in steps."""
        return self.engine_step_s / self.wall_s

    @property
    def client_cpu(self) -> float:
        """Cores the load generator kept busy: near its process count, it is the bottleneck."""
        return self.client_cpu_s / self.wall_s

    @property
    def throughput(self) -> float:
        return sum(t.num_tokens for t in self.timings) / self.wall_s

    def row(self, baseline: float | None) -> str:
        ttfts = sorted(t.ttft_s * 1e3 for t in self.timings)
        p50, p99 = statistics.median(ttfts), ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        tpots = sorted(t.tpot_s * 1e3 for t in self.timings)
        tpot, tpot_p99 = statistics.median(tpots), tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))]
        ratio = f"{self.throughput / baseline:.2f}" if baseline else "1.00"
        return (
            f"| {self.path:<44} | {self.concurrency:>3} | {len(self.timings):>4} "
            f"| {p50:8.1f} | {p99:8.1f} | {tpot:7.2f} | {tpot_p99:7.2f} "
            f"| {self.throughput:8.1f} | {ratio:>5} | {self.engine_steps:>5} "
            f"| {self.engine_ms_per_step:7.2f} | {self.engine_busy:4.2f} | {self.client_cpu:6.2f} |"
        )


TimedRequest = Callable[[str], Awaitable[RequestTiming]]
StepCounter = Callable[[], Awaitable[tuple[int, float]]]
"""The path's engine: (steps so far, their wall seconds)."""


def served_steps(client: httpx.AsyncClient, url: str) -> StepCounter:
    """The served engine's counters, from its health route (the Coordinator's stats)."""

    async def read() -> tuple[int, float]:
        response = await client.get(f"{url}/health")
        response.raise_for_status()
        stats = response.json()
        return int(stats["engine_steps"]), float(stats["engine_step_seconds"])

    return read


def local_steps(llm: AsyncLLM) -> StepCounter:
    async def read() -> tuple[int, float]:
        return llm.num_steps, llm.step_seconds

    return read


def prompt_list(first: int, count: int) -> list[str]:
    """Requests `first` .. `first + count - 1` of a level: each prompt distinct."""
    return [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(first, first + count)]


async def closed_loop(
    request: TimedRequest, concurrency: int, prompts: list[str]
) -> tuple[list[RequestTiming], float]:
    """`concurrency` clients, each sending its next request when the previous one ends."""
    remaining = iter(prompts)
    timings: list[RequestTiming] = []

    async def client() -> None:
        for prompt in remaining:
            timings.append(await request(prompt))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return timings, time.perf_counter() - start


@dataclass(frozen=True)
class ServedTarget:
    """Where a load-generator process sends one path's requests (picklable)."""

    protocol: str  # "http" or "grpc"
    address: str  # the HTTP base URL, or the gRPC host:port
    app_name: str
    max_tokens: int


_worker_loop: asyncio.AbstractEventLoop | None = None
_worker_requests: dict[ServedTarget, TimedRequest] = {}


def _worker_request(target: ServedTarget) -> TimedRequest:
    """This process's request function for `target`, its client made once on the process's loop."""
    if target not in _worker_requests:
        if target.protocol == "http":
            limits = httpx.Limits(max_connections=None)  # one connection per client of any share
            client = httpx.AsyncClient(timeout=600, limits=limits)
            _worker_requests[target] = http_request(client, target.address, target.max_tokens)
        else:
            from ddtree_serve.serve.protos import DDTreeServeStub

            stub = DDTreeServeStub(grpc.aio.insecure_channel(target.address))
            _worker_requests[target] = grpc_request(stub, target.max_tokens, target.app_name)
    return _worker_requests[target]


def _import_clients() -> None:
    """A load-generator process's imports, made as it starts: a process the warm-up missed
    (it may hand two shares to one process) pays only its clients' connections in its first
    level, not the imports."""
    from ddtree_serve.serve.protos import DDTreeServeStub, pb2  # noqa: F401


def _worker_closed_loop(
    target: ServedTarget, concurrency: int, prompts: list[str]
) -> tuple[list[RequestTiming], float]:
    """One load-generator process's share of a level: its timings and the CPU seconds it spent."""
    global _worker_loop
    if _worker_loop is None:  # one loop for the process's life: its clients stay bound to it
        _worker_loop = asyncio.new_event_loop()
        asyncio.set_event_loop(_worker_loop)

    async def share() -> list[RequestTiming]:
        timings, _ = await closed_loop(_worker_request(target), concurrency, prompts)
        return timings

    cpu_before = time.process_time()
    timings = _worker_loop.run_until_complete(share())
    return timings, time.process_time() - cpu_before


class ClientProcesses:
    """The served paths' load spread over `count` processes, so that at high concurrency the
    generator's own HTTP and gRPC work (one Python process parsing thousands of chunks a
    second) does not cap what the server is measured to do; the in-process engine's load stays
    in this process, beside its engine. Each process takes a fixed share of the level's
    requests (no shared queue across processes), so a share that ends early leaves the level's
    tail a little under its concurrency."""

    def __init__(self, count: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._pool = concurrent.futures.ProcessPoolExecutor(
            count, mp_context=context, initializer=_import_clients
        )
        self.count = count

    async def closed_loop(
        self, target: ServedTarget, concurrency: int, prompts: list[str]
    ) -> tuple[list[RequestTiming], float, float]:
        """The level's timings, wall seconds and the processes' CPU seconds."""
        loop = asyncio.get_running_loop()
        shares = [concurrency // self.count + (i < concurrency % self.count) for i in range(self.count)]
        start = time.perf_counter()
        futures, clients_before = [], 0
        for share in filter(None, shares):
            first = len(prompts) * clients_before // concurrency
            clients_before += share
            last = len(prompts) * clients_before // concurrency
            futures.append(
                loop.run_in_executor(self._pool, _worker_closed_loop, target, share, prompts[first:last])
            )
        results = await asyncio.gather(*futures)
        wall_s = time.perf_counter() - start
        return [t for timings, _ in results for t in timings], wall_s, sum(cpu for _, cpu in results)

    def shutdown(self) -> None:
        self._pool.shutdown(cancel_futures=True)


async def _timed(chunks: AsyncIterator[int]) -> RequestTiming:
    start = time.perf_counter()
    first = None
    num_tokens = 0
    async for count in chunks:
        if count and first is None:
            first = time.perf_counter() - start
        num_tokens += count
    return RequestTiming(first or 0.0, time.perf_counter() - start, num_tokens)


def http_request(client: httpx.AsyncClient, url: str, max_tokens: int) -> TimedRequest:
    async def chunks(prompt: str) -> AsyncIterator[int]:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        body["stream_options"] = {"include_usage": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            seen = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):  # the last event: the exact token count
                    yield event["usage"]["completion_tokens"] - seen
                elif event["choices"]:
                    seen += 1
                    yield 1  # one event per step; corrected by the usage event

    return lambda prompt: _timed(chunks(prompt))


def grpc_request(stub: object, max_tokens: int, app_name: str) -> TimedRequest:
    from ddtree_serve.serve.protos import pb2

    metadata = (("application", app_name),)

    async def chunks(prompt: str) -> AsyncIterator[int]:
        sampling = pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = pb2.GenerateRequest(prompt=prompt, sampling=sampling)
        async for chunk in stub.Generate(request, metadata=metadata):  # type: ignore[attr-defined]
            yield len(chunk.token_ids)

    return lambda prompt: _timed(chunks(prompt))


def engine_request(llm: AsyncLLM, max_tokens: int) -> TimedRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def chunks(prompt: str) -> AsyncIterator[int]:
        async for output in llm.generate_stream(prompt, params):
            yield len(output.delta_token_ids)

    return lambda prompt: _timed(chunks(prompt))


async def run_all(
    engine_config: EngineConfig, configs: list[ServeConfig], args: argparse.Namespace
) -> list[LevelResult]:
    """Each sweep (`--repeats`) deploys the configurations one at a time and runs every level
    in process, over HTTP and over gRPC back to back, so a load change on a shared machine hits
    all paths alike; a level's result is its median sweep. One application at a time: an idle
    compiled graph's actors poll their channels, a core each, which would slow the others."""
    from ddtree_serve.serve.protos import DDTreeServeStub

    llm = AsyncLLM(build_local_engine(engine_config))
    pool = ClientProcesses(args.client_processes) if args.client_processes > 1 else None
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    sweeps: dict[tuple[str, int], list[LevelResult]] = {}
    order = ["in-process"]
    try:
        async with (
            httpx.AsyncClient(timeout=600, limits=limits) as client,
            grpc.aio.insecure_channel(f"127.0.0.1:{configs[0].grpc.port}") as channel,
        ):
            local = engine_request(llm, args.max_tokens)
            await closed_loop(local, 1, prompt_list(0, 2))  # warm-up: first-call costs out of the figures
            for _ in range(args.repeats):
                for config in configs:
                    await asyncio.to_thread(deploy, config)
                    url = f"http://127.0.0.1:{config.http.port}/{config.app_name}"
                    grpc_address = f"127.0.0.1:{config.grpc.port}"
                    direct_channel = None
                    if args.direct_ingress:  # the ingress replica's own servers, not the proxy
                        direct = await asyncio.to_thread(direct_ingress_ports, config.app_name)
                        if set(direct) != {"http", "grpc"}:
                            raise RuntimeError("no direct ingress: run with --serve-throughput-optimized")
                        url = f"http://127.0.0.1:{direct['http']}/{config.app_name}"
                        grpc_address = f"127.0.0.1:{direct['grpc']}"
                        direct_channel = grpc.aio.insecure_channel(grpc_address)
                    stub = DDTreeServeStub(direct_channel or channel)
                    served = served_steps(client, url)
                    paths: dict[str, tuple[TimedRequest, StepCounter, ServedTarget | None]] = {
                        f"http {config.app_name}": (
                            http_request(client, url, args.max_tokens),
                            served,
                            ServedTarget("http", url, config.app_name, args.max_tokens),
                        ),
                        f"grpc {config.app_name}": (
                            grpc_request(stub, args.max_tokens, config.app_name),
                            served,
                            ServedTarget("grpc", grpc_address, config.app_name, args.max_tokens),
                        ),
                    }
                    order += [path for path in paths if path not in order]
                    for request, _, target in paths.values():
                        await closed_loop(request, 1, prompt_list(0, 2))
                        if pool is not None and target is not None:  # each process's client made
                            await pool.closed_loop(target, pool.count, prompt_list(0, 2 * pool.count))
                    paths["in-process"] = (local, local_steps(llm), None)
                    for concurrency in args.concurrency:
                        num_requests = max(args.min_requests, args.requests_per_client * concurrency)
                        prompts = prompt_list(0, num_requests)
                        for path, (request, steps, target) in paths.items():
                            steps_before, seconds_before = await steps()
                            if pool is not None and target is not None:
                                timings, wall_s, client_cpu_s = await pool.closed_loop(
                                    target, concurrency, prompts
                                )
                            else:
                                cpu_before = time.process_time()
                                timings, wall_s = await closed_loop(request, concurrency, prompts)
                                client_cpu_s = time.process_time() - cpu_before
                            steps_after, seconds_after = await steps()
                            result = LevelResult(
                                path,
                                concurrency,
                                timings,
                                wall_s,
                                steps_after - steps_before,
                                seconds_after - seconds_before,
                                client_cpu_s,
                            )
                            sweeps.setdefault((path, concurrency), []).append(result)
                    if direct_channel is not None:
                        await direct_channel.close()
                    await asyncio.to_thread(undeploy, config)
    finally:
        llm.shutdown()
        if pool is not None:
            pool.shutdown()
    medians = [sorted(runs, key=lambda r: r.throughput)[len(runs) // 2] for runs in sweeps.values()]
    return sorted(medians, key=lambda r: (order.index(r.path), r.concurrency))


def start_cluster(config: ServeConfig, ray_dir: str, throughput_optimized: bool = False) -> None:
    """One Ray cluster and Serve with the proxies of `config`; applications come and go.
    `throughput_optimized`: Ray Serve's throughput-optimized mode for the whole cluster (the
    launcher's `--serve-throughput-optimized`)."""
    import ray
    from ray import serve

    from ddtree_serve.serve.app import serve_start_options
    from ddtree_serve.serve.launcher import choose_serve_mode

    if line := choose_serve_mode(throughput_optimized):
        print(line)

    num_gpus = 1 if config.engine.device.startswith("cuda") else 0
    ray.init(address="local", num_cpus=2, num_gpus=num_gpus, include_dashboard=False, _temp_dir=ray_dir)
    serve.start(**serve_start_options(config))


def deploy(config: ServeConfig) -> None:
    from ray import serve

    from ddtree_serve.serve.app import build_app

    serve.run(build_app(config), name=config.app_name, route_prefix=f"/{config.app_name}")


def undeploy(config: ServeConfig) -> None:
    from ray import serve

    serve.delete(config.app_name)


def stop_application(ray_dir: str) -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(ray_dir, ignore_errors=True)


HOPLESS_WORKERS = ("in_process", "engine_core_colocated")
"""Placements whose models share one process: no step transport, nothing to overlap."""


def _app_name(
    workers: str, transport: str, overlap: bool, chained: bool, interval_ms: float, features: str
) -> str:
    name = f"{transport}-{'overlap' if overlap else 'serial'}"
    if workers in HOPLESS_WORKERS:
        name = workers
    elif workers != "actors":
        name = f"{workers}-{name}"
    if chained and transport != "actor_calls" and not overlap:
        name += "-chained"
    if features != "auto":
        name += f"-{features}"
    return f"{name}-{interval_ms:g}ms" if interval_ms else name


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="Target model dir (default: bundled).")
    parser.add_argument("--drafter", help="Drafter dir (default: bundled).")
    parser.add_argument("--mode", default="ddtree", choices=["ar", "chain", "ddtree"])
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="Model device of both paths (default: cpu).")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="(default: float32)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="Sweeps; each level reports its median.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="Torch threads of the in-process engine; Ray gives each worker OMP_NUM_THREADS=1.",
    )
    parser.add_argument(
        "--workers",
        nargs="+",
        default=["actors"],
        choices=get_args(PlacementWorkers),
        help="placement.workers values: drafter and target actors, the target inside the "
        "Coordinator replica and the drafter in its actor, the target and the engine loop in an "
        "engine core actor, that core with the drafter in it too, or both models inside the "
        "replica. The last two have no step hop: they run once per interval, overlap off, "
        "whatever --transport and --overlap list.",
    )
    parser.add_argument(
        "--transport",
        nargs="+",
        default=["actor_calls"],
        choices=["actor_calls", "compiled_graph", "sockets"],
        help="Served transports to compare (placement.transport).",
    )
    for flag, help_text in (
        ("--overlap", "placement.overlap values."),
        (
            "--chain-drafts",
            "placement.chain_drafts values (compiled graph, serial: next draft in the verify's execution).",
        ),
    ):
        parser.add_argument(flag, nargs="+", default=["off"], choices=["off", "on"], help=help_text)
    parser.add_argument(
        "--serve-throughput-optimized",
        action="store_true",
        help="The cluster in Ray Serve's throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1).",
    )
    parser.add_argument(
        "--direct-ingress",
        action="store_true",
        help="Send the served requests to the ingress replica's own HTTP and gRPC servers (Ray "
        "Serve's direct ingress; needs --serve-throughput-optimized) instead of the proxies.",
    )
    parser.add_argument(
        "--features",
        nargs="+",
        default=["auto"],
        choices=["auto", "device", "host"],
        help="placement.features values (device: a CUDA IPC handle whenever both actors share a "
        "GPU; auto: only under the compiled graph, from 1 MiB a call).",
    )
    parser.add_argument(
        "--stream-batching-interval-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="stream_batching_interval_ms values to compare (default: 0, a chunk per step).",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="Load-generator processes for the served paths (default: 1, this one); the "
        "in-process engine's load always runs in this process.",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engine_config = EngineConfig(
        target=args.target,
        drafter=args.drafter,
        mode=args.mode,
        budget=args.budget,
        max_num_seqs=max(args.concurrency),
        max_seq_len=512,
        device=args.device,
        dtype=args.dtype,
    )
    # On one GPU the group's drafter and target actors share it (half each); on CPU they reserve none.
    intervals = args.stream_batching_interval_ms
    combos = [
        (w, t, o == "on", c == "on", i, f)
        for w in args.workers
        for t in args.transport
        for o in args.overlap
        for c in args.chain_drafts
        for i in intervals
        for f in args.features
        if c == "off" or (t != "actor_calls" and o == "off")  # chaining changes nothing elsewhere
        if w not in ("target_in_coordinator", "engine_core") or t == "sockets"  # their one transport
        if w not in HOPLESS_WORKERS or (t == args.transport[0] and o == args.overlap[0])
    ]
    gpu_share = 0.5 if args.device.startswith("cuda") else 0.0
    http_port, grpc_port = free_ports(2)
    ports = {"http": {"port": http_port}, "grpc": {"port": grpc_port}}
    configs = [
        ServeConfig(
            app_name=_app_name(workers, transport, overlap, chained, interval, features),
            engine=engine_config,
            observability={"metrics": False},  # type: ignore[arg-type]
            placement={  # type: ignore[arg-type]
                "workers": workers,
                "transport": "auto" if workers in HOPLESS_WORKERS else transport,
                "overlap": overlap and workers not in HOPLESS_WORKERS,
                "chain_drafts": chained,
                "features": features,
                "coordinator": {"num_cpus": 0.1},
                "drafter": {"num_cpus": 0.1, "num_gpus": gpu_share},
                "target": {"num_cpus": 0.1, "num_gpus": gpu_share},
            },
            ingress={"num_cpus": 0.1},  # type: ignore[arg-type]
            stream_batching_interval_ms=interval,
            **ports,  # type: ignore[arg-type]
        )
        for workers, transport, overlap, chained, interval, features in combos
    ]
    ray_dir = tempfile.mkdtemp(prefix="ddtree-bench-")
    start_cluster(configs[0], ray_dir, args.serve_throughput_optimized)
    try:
        results = asyncio.run(run_all(engine_config, configs, args))
    finally:
        stop_application(ray_dir)

    baseline = {r.concurrency: r.throughput for r in results if r.path == "in-process"}
    print(f"\nmode={args.mode} budget={args.budget} max_tokens={args.max_tokens}", end=" ")
    print(f"workers={' '.join(args.workers)} threads={args.threads}\n")
    print(
        f"| {'path':<44} |   c | reqs | TTFT p50 | TTFT p99 | TPOT ms | TPOT p99 |    tok/s | ratio "
        "| steps | ms/step | busy | client |"
    )
    widths = [46, 5, 6, 10, 10, 9, 9, 10, 7, 7, 9, 6, 8]
    print("|" + "|".join("-" * width for width in widths) + "|")
    for result in results:
        print(result.row(None if result.path == "in-process" else baseline[result.concurrency]))
    print(f"\ndevice={args.device} dtype={args.dtype}; TTFT in ms;", end=" ")
    print("TPOT = ms per output token after the first chunk (median and p99);")
    print("ratio = tok/s / in-process tok/s at the same concurrency; steps, ms/step: the engine's steps")
    print("in the level and their mean wall time in its thread; busy: their share of the level's time;")
    print(f"client: cores the load generator used ({args.client_processes} process(es) for the served paths;")
    print("in process it includes the engine's own).")


if __name__ == "__main__":
    main()
