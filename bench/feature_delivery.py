"""One delivery of context features target -> drafter, host path against a CUDA IPC handle, between
two actors on one GPU (fractional `num_gpus`, as `serve_load.py --device cuda` places them).

A delivery starts with a target call's per-request features on the target's GPU and ends with
them on the drafter's GPU, in memory it owns. The host path (`wire.pack_features`) joins them,
copies them to the host, moves them through Ray and copies them back to the GPU; the device
path (`device_features.py`) joins them and sends a handle that the drafter opens and copies from.
Each is timed over a plain actor call (features by ObjectRef, the drafter's call taking the
target's result as its argument) and over a compiled graph (features in a channel), with the
shapes of the bundled pair (hidden 256 x 3 taps) and of a Kimi-K2.6-like target (hidden 7168 x 5
taps), bf16, 16 rows per request.

    python bench/feature_delivery.py --batch-sizes 1 16 64 --repeats 30   # on the GPU machine
"""

import argparse
import shutil
import tempfile
from typing import Any

import ray
import torch
from hop_breakdown import median_ms  # bench/ is the script's folder, first on sys.path
from ray.dag import InputNode

from ddtree_serve.serve.device_features import DeviceFeatures, wire_features
from ddtree_serve.serve.wire import from_wire

# (name, features per row): rows are hidden size x target layers tapped.
SHAPES = [("bundled pair", 256 * 3), ("Kimi-K2.6-like", 7168 * 5)]
PATHS = ("host", "device")


@ray.remote(num_cpus=0.5, num_gpus=0.25)
class Target:
    """Holds each shape's features on the GPU; a call sends one delivery of them."""

    def __init__(self) -> None:
        self._features: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def prepare(self, batch_size: int, rows: int, width: int) -> None:
        self._features[(batch_size, rows, width)] = [
            torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(batch_size)
        ]

    def send(self, request: tuple[str, int, int, int]) -> Any:
        path, batch_size, rows, width = request
        return wire_features(self._features[(batch_size, rows, width)], on_device=path == "device")


@ray.remote(num_cpus=0.5, num_gpus=0.25)
class Drafter:
    """Takes a delivery onto its GPU, as the drafter worker does, and waits for the copy."""

    def take(self, features: Any) -> int:
        if isinstance(features, DeviceFeatures):
            tensors = features.unpack()  # on the GPU, copied and synchronized
        else:
            tensors = [t.to("cuda", non_blocking=True) for t in from_wire(features).unpack()]
            torch.cuda.synchronize()
        return len(tensors)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rows", type=int, default=16, help="Rows (accepted tokens) per request.")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--num-cpus", type=int, default=4)
    args = parser.parse_args()
    ray_dir = tempfile.mkdtemp(prefix="ddtree-features-")
    ray.init(address="local", num_cpus=args.num_cpus, num_gpus=1, include_dashboard=False, _temp_dir=ray_dir)
    try:
        # An actor joins one compiled graph at most: the graph has its own pair.
        plain_target, plain_drafter, graph_target, graph_drafter = (
            Target.remote(),
            Drafter.remote(),
            Target.remote(),
            Drafter.remote(),
        )
        with InputNode() as request:
            dag = graph_drafter.take.bind(graph_target.send.bind(request))
        graph = dag.experimental_compile()
        try:
            run(args, (plain_target, plain_drafter), (graph_target, graph))
        finally:
            # The drafter's loop can outlive a plain teardown by minutes on the GPU (seen on the
            # H200): the table is printed, the actors are not needed any more.
            graph.teardown(kill_actors=True)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


def run(args: argparse.Namespace, plain: tuple[Any, Any], compiled: tuple[Any, Any]) -> None:
    plain_target, plain_drafter = plain
    graph_target, graph = compiled
    transports = {  # one delivery of a request (path, batch size, rows, width)
        "actor call": lambda r: ray.get(plain_drafter.take.remote(plain_target.send.remote(r))),
        "compiled graph": lambda r: graph.execute(r).get(),
    }
    print(f"\nmedian ms per delivery (target GPU -> drafter GPU), {args.repeats} repeats, bf16,")
    print(f"{args.rows} rows per request; both actors on one GPU\n")
    print("| shape | batch | MiB | actor call: host | device | compiled graph: host | device |")
    print("|---|---|---|---|---|---|---|")
    for name, width in SHAPES:
        for batch_size in args.batch_sizes:
            ray.get([t.prepare.remote(batch_size, args.rows, width) for t in (plain_target, graph_target)])
            mib = batch_size * args.rows * width * 2 / 2**20
            times = [
                median_ms(lambda d=deliver, r=(path, batch_size, args.rows, width): d(r), args.repeats, 5)
                for deliver in transports.values()
                for path in PATHS
            ]
            print(f"| {name} | {batch_size} | {mib:.2f} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
