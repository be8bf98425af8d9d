"""Per-step costs at real shapes, random weights: a Qwen3-8B-shaped target and its DFlash drafter.

Acceptance means nothing with random weights; costs do. With the models in bf16 and CUDA graphs
on (as served), it measures, at batch 1 and 16 over a cached prefix per request:

    draft ms     the drafter's step: append the accepted tokens' context K/V, draft the block,
                 and top-k over the block's logits (`draft_topk`, K = 64)
    verify ms    the target's verify forward over N tree tokens (N = 1 is plain decoding)
    host ms      the host side of a step: DDTree build + verify buffers + greedy walk per request
    eager ms     the same verify without graphs; full-width ms with the mask and K/V read over
                 the whole `max_seq_len` instead of the row bucket (the cost of a fixed width)

and which SDPA backends take the tree attention's boolean mask at these shapes (and their time).
From the table and acceptance lengths measured on the bundled pair (`--taus`) it predicts the
DDTree speedup over plain decoding per budget: tau * t(ar step) / t(ddtree step).
Results go to bench/out/scale.{md,json}.

    python bench/scale.py                     # H200 (CUDA, bf16)
    python bench/scale.py --tiny --device cpu # a seconds-long check of the script itself
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from ddtree_serve.engine.greedy_walk import greedy_walk_on_host

from ddtree_serve.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree_serve.models.drafter import DFlashDrafter
from ddtree_serve.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from ddtree_serve.models.runner import TargetRunner
from ddtree_serve.models.target_graphs import TargetGraphs
from ddtree_serve.tree import VerifyBatch, build_chain, build_ddtree, build_verify_batch, draft_topk

QWEN3_8B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
}
TINY = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6}
TINY.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TREE_TOKENS = (1, 16, 32, 64, 128)
BATCH_SIZES = (1, 16)
DRAFT_TOP_K = 64
DRAFT_VOCAB = 4096  # vocabulary of the random drafts the host builds trees from (cost: L and K)
# bundled pair, greedy, from README's acceptance table: budget -> tau (chain = block 16)
BUNDLED_TAUS = "chain:2.94,16:3.63,32:3.95,64:4.17,128:4.47"


def drafter_config(target: dict, num_layers: int = 5, block_size: int = 16) -> dict:
    """z-lab's Qwen3-8B-DFlash-b16 layout: target-sized layers, 5 of them, 5 tapped target layers."""
    num_target_layers = target["num_hidden_layers"]
    return {
        **target,
        "num_hidden_layers": num_layers,
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": target["vocab_size"] - 1,
            "target_layer_ids": [round(1 + i * (num_target_layers - 4) / 4) for i in range(5)],
        },
    }


def build_models(shape: dict, args: argparse.Namespace) -> tuple[TargetRunner, DFlashDrafter]:
    """Random-weight target and drafter built on the device in the bench dtype (no host copies)."""
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            target = Qwen3ForCausalLM(Qwen3Config.from_dict(shape)).eval()
            torch.nn.init.normal_(target.model.embed_tokens.weight)  # built for a checkpoint: no init
            draft_config = DFlashConfig.from_dict(drafter_config(shape))
            draft_model = DFlashDraftModel(draft_config).eval()
    finally:
        torch.set_default_dtype(previous)
    num_slots = max(BATCH_SIZES)
    runner = TargetRunner(
        target,
        num_slots=num_slots,
        max_seq_len=args.max_seq_len,
        target_layer_ids=draft_config.target_layer_ids,
    )
    drafter = DFlashDrafter(
        draft_model,
        target.model.embed_tokens.weight,
        target.lm_head.weight,
        num_slots=num_slots,
        max_seq_len=args.max_seq_len,
    )
    return runner, drafter


def device_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median milliseconds of `fn` over `reps` calls after two warm-ups (events on CUDA)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def random_draft(batch_size: int, block_size: int, k: int, vocab: int, rng: np.random.Generator):
    """Per-position top-k log-probs (descending, normalised over `vocab`) and ids: `[B, L, K]`."""
    logits = rng.normal(size=(batch_size, block_size - 1, vocab)).astype(np.float32) * 3
    logp = torch.from_numpy(logits).log_softmax(-1)
    top = logp.topk(k, dim=-1)
    return top.values.numpy(), top.indices.numpy()


def host_step(logp: np.ndarray, ids: np.ndarray, budget: int, roots: list[int]) -> VerifyBatch:
    """The host side of one step: one tree per request, the verify buffers, the greedy walk."""
    trees = [
        build_ddtree(logp[b], ids[b], budget, roots[b]) if budget > 0 else build_chain([], roots[b])
        for b in range(len(roots))
    ]
    batch = build_verify_batch(trees)
    greedy_walk_on_host(batch, batch.tokens.clamp(min=0))
    return batch


class FullWidthGraphs(TargetGraphs):
    """Verify graphs whose attention always reads the whole `max_seq_len` (one row bucket)."""

    def bucket(self, batch_size: int, num_nodes: int, max_start: int) -> tuple[int, int, int] | None:
        key = super().bucket(batch_size, num_nodes, max_start)
        return None if key is None else (key[0], key[1], self.cache.max_seq_len)


def measure(runner: TargetRunner, drafter: DFlashDrafter, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    vocab, device = runner.vocab_size, args.device
    rows: dict = {}
    for batch_size in BATCH_SIZES:
        slots = list(range(batch_size))
        for slot in slots:
            runner.release(slot)
            drafter.release(slot)
        prompts = [torch.randint(0, vocab, (args.prefix,), generator=gen) for _ in slots]
        _, features = runner.prefill_batch(slots, prompts)
        drafter.draft(slots, torch.zeros(batch_size, dtype=torch.int64), features)
        accepted = [features[b][: args.accepted] for b in range(batch_size)]
        bonus = torch.randint(0, vocab, (batch_size,), generator=gen)

        def draft_step(slots=slots, bonus=bonus, accepted=accepted) -> None:
            # each call appends `accepted` more context tokens per request
            draft_topk(drafter.draft(slots, bonus, accepted), DRAFT_TOP_K)

        row = {"draft_ms": device_ms(draft_step, device, args.reps)}
        for num_nodes in TREE_TOKENS:
            logp, ids = random_draft(
                batch_size, drafter.block_size, DRAFT_TOP_K, min(DRAFT_VOCAB, vocab), rng
            )
            roots = bonus.tolist()
            batch = host_step(logp, ids, num_nodes - 1, roots)
            assert batch.tokens.shape[1] == num_nodes, "random drafts fill the budget"
            device_batch = batch.to(device)
            t0 = time.perf_counter()
            for _ in range(args.reps):
                host_step(logp, ids, num_nodes - 1, roots)
            host_ms = 1e3 * (time.perf_counter() - t0) / args.reps

            def verify(slots=slots, batch=device_batch) -> None:
                runner.verify(slots, batch)

            graphs = runner.graphs
            entry = {"verify_ms": device_ms(verify, device, args.reps), "host_ms": host_ms}
            if graphs is not None:
                runner.graphs = None
                entry["eager_ms"] = device_ms(verify, device, max(3, args.reps // 4))
                runner.graphs = FullWidthGraphs(
                    runner.model,
                    runner.cache,
                    runner.target_layer_ids,
                    scratch_slot=graphs.scratch_slot,
                    capture=True,
                )
                entry["full_width_ms"] = device_ms(verify, device, args.reps)
                runner.graphs = graphs
            row[num_nodes] = entry
            print(f"batch {batch_size} N={num_nodes}: {entry}", flush=True)
        rows[batch_size] = row
    return rows


def attention_backends(shape: dict, args: argparse.Namespace) -> list[dict]:
    """Which SDPA kernels take a boolean tree mask at the target's shapes, and what each costs.

    Queries `[16, heads, 64, d]` over 1024 cached rows with K/V heads repeated (as the runner
    does on CUDA), bf16; each backend forced alone, then the default choice, then the mask as an
    additive bias.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=args.device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    heads, head_dim, batch, nodes, rows = shape["num_attention_heads"], shape["head_dim"], 16, 64, 1024

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=args.device, dtype=dtype)

    q, k, v = (
        rand(batch, heads, nodes, head_dim),
        rand(batch, heads, rows, head_dim),
        rand(batch, heads, rows, head_dim),
    )
    mask = torch.rand(batch, 1, nodes, rows, generator=gen, device=args.device) < 0.9
    mask[..., 0] = True
    bias = torch.zeros(mask.shape, dtype=dtype, device=args.device).masked_fill(~mask, float("-inf"))
    results = []
    cases = [
        (b.name, [b], mask)
        for b in (
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.MATH,
        )
    ]
    cases += [
        ("default", None, mask),
        ("EFFICIENT_ATTENTION, additive bias", [SDPBackend.EFFICIENT_ATTENTION], bias),
    ]
    for name, backends, attn_mask in cases:

        def attend(backends=backends, attn_mask=attn_mask) -> torch.Tensor:
            if backends is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

        try:
            results.append({"backend": name, "ms": device_ms(attend, args.device, args.reps)})
        except RuntimeError as error:
            results.append({"backend": name, "ms": None, "refused": str(error).splitlines()[0][:120]})
        print(results[-1], flush=True)
    return results


def predicted_speedups(rows: dict, taus: dict[str, float]) -> list[dict]:
    """tau * t(ar step) / t(draft + verify(N) + host) per budget, N = budget + 1 rounded to the table."""
    out = []
    for batch_size, row in rows.items():
        ar = row[1]["verify_ms"] + row[1]["host_ms"]
        for name, tau in taus.items():
            num_nodes = 16 if name == "chain" else min(TREE_TOKENS, key=lambda n: abs(n - int(name)))
            entry = row[num_nodes]
            step = row["draft_ms"] + entry["verify_ms"] + entry["host_ms"]
            out.append(
                {
                    "batch": batch_size,
                    "config": name,
                    "tau": tau,
                    "tokens": num_nodes,
                    "step_ms": step,
                    "speedup": tau * ar / step,
                }
            )
    return out


def markdown(rows: dict, backends: list[dict], speedups: list[dict], device: str, args) -> str:
    lines = [
        f"device: {device}; Qwen3-8B-shaped target + 5-layer DFlash drafter (block 16), random weights, "
        f"{args.dtype}, CUDA graphs on; prefix {args.prefix} cached tokens per request, "
        f"{args.accepted} accepted per step; max_seq_len {args.max_seq_len}",
        "",
        "| batch | draft ms | N | verify ms | host ms | verify eager ms | verify full-width ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch_size, row in rows.items():
        for num_nodes in TREE_TOKENS:
            e = row[num_nodes]
            lines.append(
                f"| {batch_size} | {row['draft_ms']:.2f} | {num_nodes} | {e['verify_ms']:.2f} | "
                f"{e['host_ms']:.2f} | {e.get('eager_ms', float('nan')):.2f} | "
                f"{e.get('full_width_ms', float('nan')):.2f} |"
            )
    lines += ["", "| SDPA backend (bool tree mask, [16, 32, 64, 128] over 1024 rows) | ms |", "|---|---:|"]
    for b in backends:
        lines.append(
            f"| {b['backend']} | {b['ms']:.3f} |" if b["ms"] is not None else f"| {b['backend']} | refused |"
        )
    lines += [
        "",
        "| batch | config | tau (bundled pair) | N | step ms | predicted speedup vs ar |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for s in speedups:
        lines.append(
            f"| {s['batch']} | {s['config']} | {s['tau']:.2f} | {s['tokens']} | {s['step_ms']:.2f} | "
            f"{s['speedup']:.2f}x |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes (a check of the script, not a figure)"
    )
    parser.add_argument(
        "--prefix", type=int, default=512, help="cached tokens per request (default %(default)s)"
    )
    parser.add_argument("--accepted", type=int, default=4, help="context tokens appended per draft")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20, help="timed calls per figure (median)")
    parser.add_argument("--taus", default=BUNDLED_TAUS, help="config:tau pairs for the prediction")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = TINY if args.tiny else QWEN3_8B
    runner, drafter = build_models(shape, args)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rows = measure(runner, drafter, args)
    backends = attention_backends(shape, args) if args.device.startswith("cuda") else []
    taus = {name: float(tau) for name, tau in (pair.split(":") for pair in args.taus.split(","))}
    speedups = predicted_speedups(rows, taus)
    table = markdown(rows, backends, speedups, device, args)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.md").write_text(table + "\n")
    payload = {
        "device": device,
        "args": vars(args),
        "rows": rows,
        "attention": backends,
        "predicted": speedups,
    }
    (out / "scale.json").write_text(json.dumps(payload, indent=1, default=str))
    print(f"\nwrote {out / 'scale.md'}, {out / 'scale.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
