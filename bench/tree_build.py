"""Cost of one step's tree work: the per-tree host path (draft_topk + build_ddtree +
build_verify_batch), the engine's host path (draft_topk + build_host_tree_batch, which pops all
requests' heaps in lockstep at large batches, + TreeBatch.verify_batch) and the batched device
builder (draft_topk + build_ddtree_batch).

Prints per-tree microseconds by stage for budgets 8..256 at L = 15, batch 1, 32 and 64, with
K = min(budget, vocab) as the engine uses. On `--device cuda` the drafter logits live on the GPU:
the host path copies the top-k to the host, the device path never leaves the GPU, and every
timed stage ends with a synchronize. Run: `python bench/tree_build.py [--vocab V] [--device D]`.
"""

from __future__ import annotations

import argparse
import time

import torch

from ddtree_serve.engine.tree_builder import build_host_tree_batch
from ddtree_serve.tree import build_ddtree, build_ddtree_batch, build_verify_batch, draft_topk

HOST_STAGES = ("draft_topk", "build_ddtree", "build_verify_batch")
ENGINE_STAGES = ("build_host_tree_batch", "TreeBatch.verify_batch")
DEVICE_STAGES = ("draft_topk", "build_ddtree_batch")


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_host_step(draft_logits: torch.Tensor, budget: int, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` seconds per host-path stage for one batch ([B, L, V] drafter logits)."""
    best = dict.fromkeys(HOST_STAGES, float("inf"))
    batch_size, device = draft_logits.shape[0], draft_logits.device
    for _ in range(repeats):
        t0 = _clock(device)
        logp, ids = draft_topk(draft_logits, budget)
        logp_np, ids_np = logp.cpu().numpy(), ids.cpu().numpy()
        t1 = time.perf_counter()
        trees = [build_ddtree(logp_np[b], ids_np[b], budget, root_token=0) for b in range(batch_size)]
        t2 = time.perf_counter()
        build_verify_batch(trees).to(device)
        t3 = _clock(device)
        for stage, seconds in zip(HOST_STAGES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            best[stage] = min(best[stage], seconds)
    return best


def time_engine_step(draft_logits: torch.Tensor, budget: int, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` seconds per stage of the engine's host build after `draft_topk`."""
    best = dict.fromkeys(ENGINE_STAGES, float("inf"))
    batch_size, device = draft_logits.shape[0], draft_logits.device
    logp, ids = draft_topk(draft_logits, budget)
    for _ in range(repeats):
        t0 = _clock(device)
        trees = build_host_tree_batch(logp, ids, [budget] * batch_size, [0] * batch_size)
        t1 = time.perf_counter()
        trees.verify_batch().to(device)
        t2 = _clock(device)
        for stage, seconds in zip(ENGINE_STAGES, (t1 - t0, t2 - t1), strict=True):
            best[stage] = min(best[stage], seconds)
    return best


def time_device_step(draft_logits: torch.Tensor, budget: int, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` seconds per device-path stage (eager ops, not a captured graph)."""
    best = dict.fromkeys(DEVICE_STAGES, float("inf"))
    batch_size, device = draft_logits.shape[0], draft_logits.device
    budgets = torch.full((batch_size,), budget, dtype=torch.int64, device=device)
    root_tokens = torch.zeros(batch_size, dtype=torch.int64, device=device)
    for _ in range(repeats):
        t0 = _clock(device)
        logp, ids = draft_topk(draft_logits, budget)
        t1 = _clock(device)
        build_ddtree_batch(logp, ids, budgets, root_tokens, budget)
        t2 = _clock(device)
        for stage, seconds in zip(DEVICE_STAGES, (t1 - t0, t2 - t1), strict=True):
            best[stage] = min(best[stage], seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=4096, help="drafter vocabulary size")
    parser.add_argument("--block-size", type=int, default=16, help="L = block_size - 1 draft positions")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="where the drafter logits and the device builder run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    num_levels = args.block_size - 1

    print(f"L={num_levels} V={args.vocab} device={device} torch threads={args.threads}; microseconds")
    print(f"per tree (best of {args.repeats}); nodes = mean tree size incl. root; host = per-tree host")
    print("path total, engine = draft_topk + the engine's host build, device = draft_topk +")
    print("build_ddtree_batch (eager)")
    stages = (*HOST_STAGES, *ENGINE_STAGES, "build_ddtree_batch")
    stage_header = " ".join(f"{s:>22}" for s in stages)
    print(f"{'batch':>5} {'budget':>6} {'nodes':>6} {stage_header} {'host':>8} {'engine':>8} {'device':>8}")
    for batch_size in args.batch_sizes:
        # Peaked logits (like a trained drafter) give deep trees rather than wide, flat ones.
        draft_logits = (torch.randn(batch_size, num_levels, args.vocab, generator=generator) * 4).to(device)
        for budget in args.budgets:
            host = time_host_step(draft_logits, budget, args.repeats)
            engine = time_engine_step(draft_logits, budget, args.repeats)
            on_device = time_device_step(draft_logits, budget, args.repeats)
            logp, ids = draft_topk(draft_logits.cpu(), budget)
            trees = [build_ddtree(logp[b], ids[b], budget, 0) for b in range(batch_size)]
            mean_nodes = sum(t.num_nodes for t in trees) / batch_size
            host_us = [host[s] / batch_size * 1e6 for s in HOST_STAGES]
            engine_us = [engine[s] / batch_size * 1e6 for s in ENGINE_STAGES]
            device_us = [on_device[s] / batch_size * 1e6 for s in DEVICE_STAGES]
            cells = " ".join(f"{us:>22.1f}" for us in (*host_us, *engine_us, device_us[1]))
            engine_total = host_us[0] + sum(engine_us)
            totals = f"{sum(host_us):>8.1f} {engine_total:>8.1f} {sum(device_us):>8.1f}"
            print(f"{batch_size:>5} {budget:>6} {mean_nodes:>6.1f} {cells} {totals}")


if __name__ == "__main__":
    main()
