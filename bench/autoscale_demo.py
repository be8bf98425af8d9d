"""Autoscaling demo: a load ramp 1 -> 64 -> 1 concurrent streams on a local 3-node cluster,
Ray Serve's generic policy against the speculation policy.

For each policy: start the multi-node cluster of `ddtree_serve.serve.local_cluster` (a head
and `--nodes` nodes of 2 fake GPUs, one speculation group per node), deploy the bundled pair
with that policy, run closed-loop streaming clients whose number follows the ramp (each stage
`--stage-s` seconds), and sample the running group count twice a second. Prints, per policy and
stage, requests/s, p50/p99 request latency and the groups seen; saves
bench/out/autoscale_demo.{png,json} (the plot: concurrency and groups over time, latency).

    python bench/autoscale_demo.py                      # both policies, a few minutes on CPU
    python bench/autoscale_demo.py --policies speculation --stage-s 20

Every request is greedy with `ignore_eos` and `--max-tokens` tokens, so requests do equal
work. On a small CPU machine all groups share the same cores: more groups buy queueing
headroom (latency under a burst), not compute; the figures show what each policy decides and
when, not what a GPU cluster would gain.
"""

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from ray import serve

from ddtree_serve.serve.app import build_app, serve_start_options
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.local_cluster import LocalClusterSpec, local_cluster
from ddtree_serve.serve.ports import free_ports

OUT_DIR = Path(__file__).resolve().parent / "out"
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "for i in range(10):"]
RAMP = [1, 2, 4, 8, 16, 32, 64, 64, 32, 16, 8, 4, 2, 1]


@dataclass(frozen=True)
class Finished:
    start_s: float  # since the run began
    latency_s: float
    status: int  # HTTP status; 0 = transport error


@dataclass
class Run:
    policy: str
    stages: list[tuple[float, float, int]] = field(default_factory=list)  # (start_s, end_s, streams)
    requests: list[Finished] = field(default_factory=list)
    groups: list[tuple[float, int]] = field(default_factory=list)  # (time_s, running groups)


def serve_config(policy: str, args: argparse.Namespace, ports: tuple[int, int]) -> ServeConfig:
    return ServeConfig.model_validate(
        {
            "engine": {
                "max_num_seqs": args.max_num_seqs,
                "max_queue_len": 64,
                "max_seq_len": 512,
                "budget": 16,
            },
            "placement": {
                "coordinator": {"num_cpus": 0},  # group nodes carry no CPUs (local_cluster.py)
                "drafter": {"num_cpus": 0, "num_gpus": 1},
                "target": {"num_cpus": 0, "num_gpus": 1},
                "node_type": {"accelerator_type:B300": 0.001},
            },
            "ingress": {"num_cpus": 0.25, "max_ongoing_requests": 512},
            "autoscaling": {
                "policy": policy,
                "min_replicas": 1,
                "max_replicas": args.nodes,
                # The generic policy aims for the same per-group load as the band's target.
                "target_ongoing_requests": 0.75 * args.max_num_seqs,
                "upscale_delay_s": 2.0,
                "downscale_delay_s": 10.0,
                "look_back_period_s": 3.0,
                "metrics_interval_s": 0.5,
            },
            "observability": {"metrics": False},
            "stream_batching_interval_ms": 0.0,  # a chunk per step, as the earlier runs streamed
            "http": {"port": ports[0]},
            "grpc": {"port": ports[1]},
        }
    )


async def client(
    http: httpx.AsyncClient, url: str, run: Run, t0: float, index: int, stop: asyncio.Event, max_tokens: int
) -> None:
    """One stream after another until `stop`; each request's latency is start -> last event."""
    body = {"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    while not stop.is_set():
        start = time.perf_counter()
        status = 0
        try:
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                status = response.status_code
                async for _ in response.aiter_lines():
                    pass
        except httpx.HTTPError:
            status = 0
        run.requests.append(Finished(start - t0, time.perf_counter() - start, status))
        if status != 200:
            await asyncio.sleep(0.5)  # the service asked to retry later (503) or failed


async def sample_groups(run: Run, app_name: str, t0: float, done: asyncio.Event) -> None:
    while not done.is_set():
        deployment = serve.status().applications[app_name].deployments["Coordinator"]
        run.groups.append((time.perf_counter() - t0, int(deployment.replica_states.get("RUNNING", 0))))
        await asyncio.sleep(0.5)


async def ramp(run: Run, config: ServeConfig, args: argparse.Namespace) -> None:
    url = f"http://127.0.0.1:{config.http.port}"
    t0 = time.perf_counter()
    done = asyncio.Event()
    sampler = asyncio.create_task(sample_groups(run, config.app_name, t0, done))
    limits = httpx.Limits(max_connections=max(RAMP) + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        clients: list[tuple[asyncio.Task[None], asyncio.Event]] = []
        for streams in RAMP:
            start = time.perf_counter() - t0
            while len(clients) < streams:
                stop = asyncio.Event()
                task = asyncio.create_task(client(http, url, run, t0, len(clients), stop, args.max_tokens))
                clients.append((task, stop))
            while len(clients) > streams:  # a stopped client finishes its request first
                task, stop = clients.pop()
                stop.set()
            await asyncio.sleep(args.stage_s)
            run.stages.append((start, time.perf_counter() - t0, streams))
            print(f"  {run.policy}: {streams:>2} streams, groups {run.groups[-1][1]}", flush=True)
        for _, stop in clients:
            stop.set()
        await asyncio.gather(*(task for task, _ in clients))
    done.set()
    await sampler


def run_policy(policy: str, args: argparse.Namespace) -> Run:
    http_port, grpc_port = free_ports(2)
    config = serve_config(policy, args, (http_port, grpc_port))
    spec = LocalClusterSpec(num_gpu_nodes=args.nodes, gpus_per_node=2, log_to_driver=False)
    temp_dir = Path(tempfile.mkdtemp(prefix="ddtree-autoscale-"))
    run = Run(policy)
    try:
        with local_cluster(spec, temp_dir):
            serve.start(**serve_start_options(config))
            serve.run(build_app(config), name=config.app_name, route_prefix="/")
            asyncio.run(ramp(run, config, args))
            serve.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return run


def stage_rows(run: Run) -> list[dict[str, Any]]:
    rows = []
    for start, end, streams in run.stages:
        done = [r for r in run.requests if start <= r.start_s + r.latency_s < end]
        ok = sorted(r.latency_s for r in done if r.status == 200)
        groups = [count for t, count in run.groups if start <= t < end] or [0]
        rows.append(
            {
                "streams": streams,
                "requests_per_s": len(ok) / (end - start),
                "p50_s": statistics.median(ok) if ok else float("nan"),
                "p99_s": ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else float("nan"),
                "refused": sum(r.status != 200 for r in done),
                "groups_mean": statistics.fmean(groups),
                "groups_max": max(groups),
            }
        )
    return rows


def print_table(runs: list[Run]) -> None:
    print("\n| policy      | streams | req/s | p50 s | p99 s | refused | groups (mean / max) |")
    print("|-------------|--------:|------:|------:|------:|--------:|--------------------:|")
    for run in runs:
        for row in stage_rows(run):
            groups = f"{row['groups_mean']:6.2f} / {row['groups_max']}"
            print(
                f"| {run.policy:<11} | {row['streams']:>7} | {row['requests_per_s']:5.2f} "
                f"| {row['p50_s']:5.2f} | {row['p99_s']:5.2f} | {row['refused']:>7} | {groups:>19} |"
            )
    for run in runs:
        ok = [r for r in run.requests if r.status == 200]
        latencies = sorted(r.latency_s for r in ok)
        group_seconds = sum(
            count * (t_next - t) for (t, count), (t_next, _) in zip(run.groups, run.groups[1:], strict=False)
        )
        print(
            f"{run.policy}: {len(ok)} requests, p50 {statistics.median(latencies):.2f}s, "
            f"p99 {latencies[int(0.99 * (len(latencies) - 1))]:.2f}s, {group_seconds:.0f} group-seconds"
        )


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for run in runs:
        times, counts = zip(*run.groups, strict=True)
        axes[0].step(times, counts, where="post", label=f"groups ({run.policy})")
        ok = sorted((r for r in run.requests if r.status == 200), key=lambda r: r.start_s + r.latency_s)
        rows = stage_rows(run)
        mids = [(start + end) / 2 for start, end, _ in run.stages]
        axes[1].plot(mids, [row["requests_per_s"] for row in rows], marker="o", label=run.policy)
        axes[2].scatter(
            [r.start_s + r.latency_s for r in ok], [r.latency_s for r in ok], s=3, label=run.policy
        )
    stage_times = [start for start, _, _ in runs[0].stages] + [runs[0].stages[-1][1]]
    streams = [streams for _, _, streams in runs[0].stages]
    twin = axes[0].twinx()
    twin.step(
        stage_times, [*streams, streams[-1]], where="post", color="grey", linestyle=":", label="streams"
    )
    twin.set_ylabel("concurrent streams")
    axes[0].set_ylabel("running groups")
    axes[0].legend(loc="upper left")
    axes[1].set_ylabel("requests / s")
    axes[1].legend()
    axes[2].set_ylabel("request latency (s)")
    axes[2].set_xlabel("time (s)")
    axes[2].legend()
    fig.suptitle("Load ramp 1 -> 64 -> 1 streams: generic vs speculation autoscaling (CPU, 3 fake-GPU nodes)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policies", nargs="+", default=["generic", "speculation"])
    parser.add_argument("--nodes", type=int, default=3, help="group-hosting nodes = most groups")
    parser.add_argument("--stage-s", type=float, default=8.0, help="seconds per ramp stage")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args()
    runs = []
    for policy in args.policies:
        print(f"policy {policy}: ramp {RAMP} x {args.stage_s:g}s", flush=True)
        runs.append(run_policy(policy, args))
    print_table(runs)
    OUT_DIR.mkdir(exist_ok=True)
    plot(runs, OUT_DIR / "autoscale_demo.png")
    results = {
        run.policy: {
            "stages": stage_rows(run),
            "groups": run.groups,
            "requests": [asdict(r) for r in run.requests],
        }
        for run in runs
    }
    (OUT_DIR / "autoscale_demo.json").write_text(json.dumps(results))
    print(f"saved {OUT_DIR / 'autoscale_demo.png'} and .json")


if __name__ == "__main__":
    main()
