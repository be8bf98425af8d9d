"""Acceptance benchmark of a target + DFlash drafter pair (the bundled one by default).

Measures, on held-out prompts (windows of the held-out stdlib files, which the pair never
trained on):
  - the target's held-out next-token loss;
  - the mean acceptance length tau (tokens per verify step) of chain drafting (the linear
    DFlash draft) and of DDTree at several node budgets, at temperature 0 and 1,
through the engine's public `LLM` API. Prints a table and saves bench/out/acceptance.{png,json}.

    python bench/acceptance.py                      # 64 prompts, 64 new tokens, CPU
    python bench/acceptance.py --max-tokens 128 --device cuda
"""

import argparse
import json
import time
from pathlib import Path

import torch

from ddtree_serve.engine import LLM, SamplingParams
from ddtree_serve.models import bundled_drafter_dir, bundled_target_dir, load_target_model, load_tokenizer
from ddtree_serve.training.corpus import load_corpus
from ddtree_serve.training.data import encode_stream
from ddtree_serve.training.target import heldout_lm_loss
from ddtree_serve.training.tokenizer import special_token_ids

LOSS_SEQ_LEN = 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=bundled_target_dir(), help="target model dir")
    parser.add_argument("--drafter", type=Path, default=bundled_drafter_dir(), help="DFlash drafter dir")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--budgets", default="8,16,32,64,128", help="DDTree node budgets, comma-separated")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="engine batch size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "out")
    return parser.parse_args()


def heldout_stream(tokenizer) -> torch.Tensor:
    """The held-out standard-library files (this interpreter's), tokenized end to end."""
    eos_id, _ = special_token_ids(tokenizer)
    _, heldout_docs = load_corpus()
    return encode_stream(tokenizer, heldout_docs, eos_id)


def heldout_prompts(stream: torch.Tensor, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """`num_prompts` windows spread evenly over the held-out stream (deterministic)."""
    last_start = stream.numel() - prompt_tokens
    starts = torch.linspace(0, last_start, num_prompts).long().tolist()
    return [stream[s : s + prompt_tokens].tolist() for s in starts]


def mean_acceptance(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float]:
    """(tau over all verify steps of all requests, seconds)."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    steps = sum(out.stats.steps for out in outputs)
    accepted = sum(out.stats.acceptance_length * out.stats.steps for out in outputs)
    return accepted / max(steps, 1), seconds


def plot(results: dict, budgets: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (temperature, row) in enumerate(results.items()):
        color = f"C{i}"
        ax.plot(
            budgets, [row[f"ddtree{b}"] for b in budgets], "o-", color=color, label=f"DDTree, T={temperature}"
        )
        ax.axhline(row["chain"], linestyle="--", color=color, label=f"chain, T={temperature}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("DDTree node budget")
    ax.set_ylabel("mean acceptance length (tokens / step)")
    ax.set_title("Bundled pair on held-out stdlib prompts")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    budgets = [int(b) for b in args.budgets.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    tokenizer = load_tokenizer(args.target)
    stream = heldout_stream(tokenizer)
    prompts = heldout_prompts(stream, args.num_prompts, args.prompt_tokens)

    target = load_target_model(args.target, device=args.device)
    loss = heldout_lm_loss(target, stream.to(args.device), LOSS_SEQ_LEN, batch_size=8)
    del target
    print(f"held-out: {stream.numel()} tokens; target loss {loss:.4f} nats/token")

    common = dict(device=args.device, max_num_seqs=args.max_num_seqs)
    chain = LLM(str(args.target), str(args.drafter), mode="chain", **common)
    ddtree = LLM(str(args.target), str(args.drafter), mode="ddtree", budget=max(budgets), **common)
    results: dict[str, dict[str, float]] = {}
    seconds: dict[str, dict[str, float]] = {}
    for temperature in temperatures:
        key = f"{temperature:g}"
        results[key], seconds[key] = {}, {}

        def params(budget: int | None, temperature: float = temperature) -> list[SamplingParams]:
            return [
                SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=temperature,
                    seed=args.seed + i,
                    ignore_eos=True,
                    draft_budget=budget,
                )
                for i in range(len(prompts))
            ]

        results[key]["chain"], seconds[key]["chain"] = mean_acceptance(chain, prompts, params(None))
        for budget in budgets:
            name = f"ddtree{budget}"
            results[key][name], seconds[key][name] = mean_acceptance(ddtree, prompts, params(budget))
        print(f"T={key}: " + ", ".join(f"{name} {tau:.3f}" for name, tau in results[key].items()), flush=True)

    columns = ["chain", *[f"ddtree{b}" for b in budgets]]
    print()
    print(f"mean acceptance length, {len(prompts)} held-out prompts x {args.max_tokens} new tokens")
    print("| T | " + " | ".join(["chain", *[f"DDTree({b})" for b in budgets]]) + " | DDTree(64)/chain |")
    print("|---" * (len(columns) + 2) + "|")
    for key, row in results.items():
        ratio = row["ddtree64"] / row["chain"] if "ddtree64" in row else float("nan")
        print(f"| {key} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + f" | {ratio:.2f}x |")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "target": str(args.target),
        "drafter": str(args.drafter),
        "target_heldout_loss": loss,
        "num_prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "acceptance_length": results,
        "seconds": seconds,
    }
    (args.out_dir / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, budgets, args.out_dir / "acceptance.png")
    print(f"saved {args.out_dir / 'acceptance.png'} and acceptance.json")


if __name__ == "__main__":
    main()
