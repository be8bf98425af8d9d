"""What one Ray call costs by payload shape, on this host: a compiled graph's execution and a
plain actor call, with echo actors (no work).

The served step's hops cost ~3 ms on some H200 hosts whether a step is one compiled-graph
execution or two (`hop_breakdown.py`); this asks whether that is a fixed cost per execution or
the payload's (de)serialization: many small arrays (what the wire format sent before `Wired`:
one array per tensor of a `VerifyInput`), the same tensors through `to_wire` (one buffer), one
bare array, or an int.

    python bench/channel_cost.py --repeats 500
"""

import argparse
import shutil
import tempfile
from typing import Any

import numpy as np
import ray
import torch
from hop_breakdown import median_ms  # bench/ is the script's folder, first on sys.path
from ray.dag import InputNode, MultiOutputNode

from ddtree_serve.serve.wire import to_wire


def payloads(num_arrays: int, array_bytes: int) -> dict[str, Any]:
    """The payload shapes compared: the same bytes as one numpy array per tensor (the wire
    format before `Wired`), as `to_wire` packs them (one buffer), as a bare array, and none."""
    tensors = [torch.zeros(array_bytes // 8, dtype=torch.int64) for _ in range(num_arrays)]
    return {
        "int": 1,
        f"{num_arrays} arrays in a list": [t.numpy() for t in tensors],
        f"to_wire of {num_arrays} tensors": to_wire(tensors),
        "one array, same bytes": np.zeros(num_arrays * array_bytes // 8, dtype=np.int64),
    }


@ray.remote(num_cpus=0.1)
class Echo:
    def echo(self, value: Any) -> Any:
        return value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--num-arrays", type=int, default=12, help="Arrays in the nested payload.")
    parser.add_argument("--array-bytes", type=int, default=256)
    parser.add_argument("--num-cpus", type=int, default=4)
    args = parser.parse_args()
    ray_dir = tempfile.mkdtemp(prefix="ddtree-channel-")
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _temp_dir=ray_dir)
    try:
        # An actor joins one compiled graph at most: each graph has its own.
        plain, alone, first, second = (Echo.remote() for _ in range(4))
        ray.get([actor.echo.remote(0) for actor in (plain, alone, first, second)])
        with InputNode() as value:
            one = alone.echo.bind(value)
        single = one.experimental_compile()
        with InputNode() as value:
            chain = MultiOutputNode([second.echo.bind(first.echo.bind(value))])
        chained = chain.experimental_compile()
        print(f"\nmedian ms per round trip, {args.repeats} repeats\n")
        print("| payload | actor call | compiled graph, 1 actor | compiled graph, 2 actors in a row |")
        print("|---|---|---|---|")
        try:
            for name, payload in payloads(args.num_arrays, args.array_bytes).items():
                call = median_ms(lambda p=payload: ray.get(plain.echo.remote(p)), args.repeats, 10)
                graph = median_ms(lambda p=payload: single.execute(p).get(), args.repeats, 10)
                two = median_ms(lambda p=payload: chained.execute(p)[0].get(), args.repeats, 10)
                print(f"| {name} | {call:.3f} | {graph:.3f} | {two:.3f} |")
        finally:
            single.teardown()
            chained.teardown()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
