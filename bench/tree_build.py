"""Host-side cost of one step's tree work: draft_topk + build_ddtree + build_verify_batch.

Prints per-tree microseconds split by stage for budgets 8..256 at L = 15, batch 1 and 32,
with K = min(budget, vocab) as the engine uses. Run: `python bench/tree_build.py [--vocab V]`.
"""

from __future__ import annotations

import argparse
import time

import torch

from ddtree_serve.tree import build_ddtree, build_verify_batch, draft_topk

STAGES = ("draft_topk", "build_ddtree", "build_verify_batch")


def time_step(draft_logits: torch.Tensor, budget: int, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` seconds per stage for one batch ([B, L, V] drafter logits)."""
    best = dict.fromkeys(STAGES, float("inf"))
    batch_size = draft_logits.shape[0]
    for _ in range(repeats):
        t0 = time.perf_counter()
        logp, ids = draft_topk(draft_logits, budget)
        logp_np, ids_np = logp.numpy(), ids.numpy()
        t1 = time.perf_counter()
        trees = [build_ddtree(logp_np[b], ids_np[b], budget, root_token=0) for b in range(batch_size)]
        t2 = time.perf_counter()
        build_verify_batch(trees)
        t3 = time.perf_counter()
        for stage, seconds in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            best[stage] = min(best[stage], seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=4096, help="drafter vocabulary size")
    parser.add_argument("--block-size", type=int, default=16, help="L = block_size - 1 draft positions")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    num_levels = args.block_size - 1

    print(f"L={num_levels} V={args.vocab} torch threads={args.threads}; microseconds per tree (best of")
    print(f"{args.repeats}); nodes = mean tree size incl. root")
    header = f"{'batch':>5} {'budget':>6} {'nodes':>6} " + " ".join(f"{s:>18}" for s in STAGES)
    print(header + f" {'total':>8}")
    for batch_size in args.batch_sizes:
        # Peaked logits (like a trained drafter) give deep trees rather than wide, flat ones.
        draft_logits = torch.randn(batch_size, num_levels, args.vocab, generator=generator) * 4
        for budget in args.budgets:
            best = time_step(draft_logits, budget, args.repeats)
            logp, ids = draft_topk(draft_logits, budget)
            trees = [build_ddtree(logp[b], ids[b], budget, 0) for b in range(batch_size)]
            mean_nodes = sum(t.num_nodes for t in trees) / batch_size
            per_tree_us = [best[s] / batch_size * 1e6 for s in STAGES]
            cells = " ".join(f"{us:>18.1f}" for us in per_tree_us)
            print(f"{batch_size:>5} {budget:>6} {mean_nodes:>6.1f} {cells} {sum(per_tree_us):>8.1f}")


if __name__ == "__main__":
    main()
