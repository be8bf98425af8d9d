"""What the start-up capture of CUDA graphs costs, and what it saves the first requests.

Builds an in-process engine (fixed budget) on a CUDA device, which captures its verify graphs
and the drafter's block graphs before the first request (`engine.graph_warmup`), then runs
`--concurrency` requests twice. Prints the start-up seconds, the graphs held after start-up,
and the memory the CUDA caching allocator holds, and, per run, the graphs captured during it
and its tokens/s: graphs captured during the first
run are the shapes the warm-up leaves to first meetings (longer contexts, the drafter's appends).

    python bench/startup_capture.py --budget 64 --max-num-seqs 64 --concurrency 16
"""

import argparse
import logging
import time

import torch
from budget_sweep import _num_graphs

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=int, default=64, help="draft nodes per tree (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests per run (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", help="(default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = EngineConfig(
        device="cuda", dtype=args.dtype, budget=args.budget, max_num_seqs=args.max_num_seqs, max_seq_len=512
    )
    started = time.perf_counter()
    engine = build_local_engine(config)
    held = _num_graphs(engine.target, engine.drafter)
    reserved_gib = torch.cuda.memory_reserved() / 2**30
    seconds = time.perf_counter() - started
    print(f"start-up: {seconds:.1f} s, {held} graphs held, {reserved_gib:.2f} GiB reserved")
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for run in (1, 2):
        before = _num_graphs(engine.target, engine.drafter)
        for i in range(args.concurrency):
            engine.add_request(f"{run}-{i}", f"def function_{i}(x):\n    return", params)
        started, tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            tokens += sum(out.num_new_tokens for out in engine.step())
        elapsed = time.perf_counter() - started
        captured = _num_graphs(engine.target, engine.drafter) - before
        reserved_gib = torch.cuda.memory_reserved() / 2**30
        rate = tokens / elapsed
        print(f"run {run}: {rate:.0f} tok/s, {captured} graphs captured during it, {reserved_gib:.2f} GiB")


if __name__ == "__main__":
    main()
