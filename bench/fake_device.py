"""The adaptive budget against fixed ones on this host, with models that take a device's time.

The budget sweep on the H200 mixes two things: the policy's choices, and the Python the
engine and the policy spend per step on a host where a whole step is 3-7 ms. This runs the
real `SpecEngine` (scheduler, host tree build, the adaptive policy, bookkeeping) over two
instant stand-in models that hold the host for the time a cost file says their forward takes
(busy-waiting, as a synchronizing copy from the device would; the host work a CUDA target runs
while its device verifies, `while_verifying`, runs within that time here too): `FakeTarget` verifies trees
against a fixed "true" continuation per slot, `FakeDrafter` proposes it through a noisy top-K
(the true token at rank 0, 1 or 2, or missing, more often missing deeper in the block). So
tokens/s here are what the engine would reach on that device if its forwards cost what the file
says, and the difference between the adaptive engine and a fixed budget at the same width is
this host's policy work. It is a host-in-the-loop simulation, not a measurement of the models.

    python bench/fake_device.py --cost bench/costs/bundled_pair_h200_bf16.json --concurrency 1 4 16 64

`--variant SETTINGS` (repeatable, `step_kinds.py`'s) adds an adaptive engine whose draft gate is
built with other settings, and each adaptive engine's median over the best fixed budget round
by round is printed per level: an A/B of a gate setting on the fake device, e.g.

    python bench/fake_device.py --cost bench/costs/bundled_pair_h100_bf16.json --stand-in measured \
        --hit-spread 0.5 --max-tokens 256 --max-seq-len 1024 --concurrency 4 8 16 --variant drain_power=4
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_sweep import StepLog, markdown_table, paired_ratios, row_line, tokens_per_s  # the sweep's own
from step_kinds import add_variant_argument

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.budget import CostCurve, DraftGate, load_cost_curve
from ddtree_serve.engine.builder import bundled_target_dir
from ddtree_serve.engine.interfaces import (
    DraftInput,
    DraftOutput,
    EncodeInput,
    PrefillInput,
    PrefillOutput,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.models.cuda_graphs import TOKEN_BUCKETS

BLOCK_SIZE = 16
"""Positions per draft block (the bundled drafter's)."""


def hold(ms: float) -> None:
    """Keep the host busy for `ms` milliseconds: a device forward the host waits for."""
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        pass


def truth(slots: np.ndarray, positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token at each absolute position of each slot's text (both fakes agree on it)."""
    mixed = (slots.astype(np.int64) * 1_000_003 + positions.astype(np.int64) * 7919) % 2_147_483_647
    return 1 + (mixed * 48271 % 2_147_483_647) % (vocab_size - 1)


def noise(slots: np.ndarray, positions: np.ndarray, salt: int) -> np.ndarray:
    """A deterministic uniform draw in [0, 1) per (slot, position)."""
    mixed = (slots.astype(np.int64) * 2_654_435_761 + positions.astype(np.int64) * 40503 + salt * 97) % (
        1 << 31
    )
    return ((mixed * 1_103_515_245 + 12345) % (1 << 31)) / float(1 << 31)


class FakeTarget:
    """Verifies trees against `truth`, greedily; holds the host for the cost curve's verify time."""

    def __init__(self, cost: CostCurve, vocab_size: int, max_seq_len: int) -> None:
        self.cost = cost
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = ()
        self.max_seq_len = max_seq_len
        self.verify_token_buckets = TOKEN_BUCKETS
        self.cached: dict[int, int] = {}
        # An `AsyncDeviceTarget`, like a CUDA one: the engine's host work given here runs within
        # the forward's time, as it runs while the device computes.
        self.while_verifying: Callable[[], None] | None = None

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        lengths = [len(p) for p in inputs.prompts]
        hold(float(self.cost.verify_ms(len(lengths), sum(lengths))))
        slots = np.asarray(inputs.slots)
        for slot, n in zip(inputs.slots, lengths, strict=True):
            self.cached[slot] = n
        first = truth(slots, np.asarray(lengths), self.vocab_size)
        return PrefillOutput(torch.from_numpy(first), tuple(lengths), lengths)

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        batch = inputs.batch
        started = time.perf_counter()
        if self.while_verifying is not None:
            self.while_verifying()
        forward_ms = float(self.cost.verify_ms(batch.batch_size, batch.batch_size * batch.padded_num_nodes))
        hold(forward_ms - 1000.0 * (time.perf_counter() - started))
        tokens, first_child = batch.tokens.numpy(), batch.retrieve_next_token.numpy()
        sibling = batch.retrieve_next_sibling.numpy()
        width = batch.max_depth + 1
        accept_index = np.full((batch.batch_size, width), -1, dtype=np.int64)
        accept_tokens = np.zeros((batch.batch_size, width), dtype=np.int64)
        accept_len = np.zeros(batch.batch_size, dtype=np.int64)
        bonus = np.zeros(batch.batch_size, dtype=np.int64)
        cached = []
        for row, slot in enumerate(inputs.slots):
            start = self.cached[slot]
            node, depth = 0, 0
            accept_index[row, 0], accept_tokens[row, 0] = 0, tokens[row, 0]
            child = first_child[row, 0]
            while child >= 0:
                expected = truth(np.array([slot]), np.array([start + depth + 1]), self.vocab_size)[0]
                if tokens[row, child] == expected:
                    node, depth = child, depth + 1
                    accept_index[row, depth], accept_tokens[row, depth] = node, tokens[row, node]
                    child = first_child[row, node]
                else:
                    child = sibling[row, child]
            accept_len[row] = depth
            bonus[row] = truth(np.array([slot]), np.array([start + depth + 1]), self.vocab_size)[0]
            self.cached[slot] = start + depth + 1
            cached.append(self.cached[slot])
        return VerifyOutput(
            accept_index=torch.from_numpy(accept_index),
            accept_tokens=torch.from_numpy(accept_tokens),
            accept_len=torch.from_numpy(accept_len),
            bonus_token=torch.from_numpy(bonus),
            num_cached_tokens=tuple(cached),
            context=None if not inputs.return_context else (accept_len + 1).tolist(),
        )

    def encode_context(self, inputs: EncodeInput) -> list[int]:
        return [len(ids) for ids in inputs.token_ids]

    def release(self, slot: int) -> None:
        self.cached.pop(slot, None)


@dataclass(frozen=True)
class StandIn:
    """How well `FakeDrafter` guesses: the true token at rank 0 with probability `hit * decay**d`
    at block position d, else at rank r = 1, 2, ... for a share `miss_shares[r - 1]` of the misses,
    else absent from the top-K."""

    hit: float
    decay: float
    miss_shares: tuple[float, ...]


STAND_INS = {
    # The first stand-in: width buys little (a miss is absent three times in five).
    "classic": StandIn(hit=0.85, decay=0.93, miss_shares=(0.2, 0.2)),
    # Fitted to the bundled drafter's fixed budgets on an H100 (`bench/request_gains.py`, c = 8
    # closed, 64 tokens): with `--hit-spread 0.5` its runs take 24, 23, 19 and 17 steps at
    # budgets 8, 16, 32 and 64, the drafter's 25, 23, 20 and 20.
    "measured": StandIn(hit=0.95, decay=0.93, miss_shares=(0.5, 0.25, 0.1)),
}


class FakeDrafter:
    """Proposes `truth` through a noisy top-K; holds the host for the cost curve's draft time.

    Per position d of the block (1-based), the true token is at rank 0 with probability
    `hit * decay**d`, else at a lower rank or absent (`StandIn`); the rank-0
    probability the drafter states is higher where it is right, as a real drafter's is, and the
    log-probs descend along the ranks (`DraftOutput`). `catch_up_ms`: what each newcomer's first
    draft (its prompt through the drafter) holds on top of the call's price (`--catch-up-ms`)."""

    def __init__(
        self,
        cost: CostCurve,
        vocab_size: int,
        stand_in: StandIn = STAND_INS["classic"],
        catch_up_ms: float = 0.0,
        hit_spread: float = 0.0,
    ) -> None:
        self.cost = cost
        self.hit_spread = hit_spread
        self.catch_up_ms = catch_up_ms
        self.vocab_size = vocab_size
        self.block_size = BLOCK_SIZE
        self.hit, self.decay = stand_in.hit, stand_in.decay
        self.miss_edges = np.cumsum(stand_in.miss_shares)  # [R]: misses at ranks 1..R below each
        self.context: dict[int, int] = {}

    def is_available(self) -> bool:
        return True

    def draft(self, inputs: DraftInput) -> DraftOutput:
        newcomers = sum(slot not in self.context for slot in inputs.slots)
        hold(self.cost.draft_ms(len(inputs.slots)) + self.catch_up_ms * newcomers)
        for slot, slices in zip(inputs.slots, inputs.contexts, strict=True):
            self.context[slot] = self.context.get(slot, 0) + sum(s.handle[s.index] for s in slices)
        slots = np.asarray(inputs.slots)[:, None]
        num_levels, num_ranks = self.block_size - 1, inputs.top_k
        starts = np.array([self.context[s] for s in inputs.slots])[:, None]
        positions = starts + np.arange(1, num_levels + 1)[None, :]  # [B, L]
        true = truth(slots, positions, self.vocab_size)
        u, v = noise(slots, positions, 1), noise(slots, positions, 2)
        # Each slot's text is its own: some are harder to predict (a hit rate up to `hit_spread`
        # lower), as prompts are, and a closed batch lasts as long as its hardest.
        hit = self.hit * (1.0 - self.hit_spread * noise(slots, np.zeros_like(slots), 3))  # [B, 1]
        p_hit = hit * self.decay ** np.arange(1, num_levels + 1)[None, :]
        # A miss's rank: the first r whose share edge its draw falls below (past them all, or
        # past the top-K: absent).
        missed = (u - p_hit) / (1 - p_hit)  # [B, L], uniform in [0, 1) where u >= p_hit
        rank = 1 + np.searchsorted(self.miss_edges, missed, side="right")
        absent = (rank > len(self.miss_edges)) | (rank >= num_ranks)
        rank = np.where(u < p_hit, 0, np.where(absent, -1, rank))
        # The stated rank-0 probability, above a third, so rank r > 0's (1 - top) / 2**r is below it.
        top = np.where(rank == 0, 0.45 + 0.5 * v, 0.34 + 0.3 * v)
        ranks = np.arange(num_ranks)[None, None, :]
        probs = np.where(ranks == 0, top[..., None], (1 - top[..., None]) * 0.5**ranks)
        ids = (true[..., None] + 17 * (ranks + 1)) % (self.vocab_size - 1) + 1  # wrong tokens
        ids = np.where(ranks == rank[..., None], true[..., None], ids)
        logp = np.log(np.maximum(probs, 1e-12)).astype(np.float32)
        return DraftOutput(
            torch.from_numpy(logp),
            torch.from_numpy(ids.astype(np.int64)),
            tuple(self.context[s] for s in inputs.slots),
        )

    def release(self, slot: int) -> None:
        self.context.pop(slot, None)


def engines(args: argparse.Namespace, cost_path: str, tokenizer) -> dict[str, SpecEngine]:
    """AR, each fixed budget, the adaptive policy and its `--variant`s, each over its own fakes."""
    base = EngineConfig(
        budget=max(args.budgets),
        max_num_seqs=max(args.concurrency),
        max_seq_len=args.max_seq_len,
        max_num_batched_tokens=1 << 20,
    )
    vocab_size = tokenizer.get_vocab_size()

    def fakes() -> tuple[FakeTarget, FakeDrafter]:
        cost = load_cost_curve(cost_path)
        drafter = FakeDrafter(
            cost,
            vocab_size,
            stand_in=STAND_INS[args.stand_in],
            catch_up_ms=args.catch_up_ms,
            hit_spread=args.hit_spread,
        )
        return FakeTarget(cost, vocab_size, args.max_seq_len), drafter

    made: dict[str, SpecEngine] = {}
    target, _ = fakes()
    made["ar"] = SpecEngine(base.model_copy(update={"mode": "ar"}).to_settings(), target, None, tokenizer)
    for budget in args.budgets:
        target, drafter = fakes()
        settings = base.model_copy(update={"budget": budget}).to_settings()
        made[f"ddtree-{budget}"] = SpecEngine(settings, target, drafter, tokenizer)
    settings = base.model_copy(update={"budget_policy": "adaptive", "cost_curve": cost_path}).to_settings()
    for gate in [None, *args.variant]:
        target, drafter = fakes()
        engine = SpecEngine(settings, target, drafter, tokenizer)
        if gate is not None:
            engine.budget_policy.gate = DraftGate(**gate)
        made[variant_name(gate)] = engine
    return made


def variant_name(gate: dict | None) -> str:
    """An adaptive engine's name: `adaptive`, or with its gate's settings (`--variant`)."""
    return "adaptive" + ("" if gate is None else " " + ",".join(f"{k}={v}" for k, v in gate.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cost",
        default=str(Path(__file__).resolve().parent / "costs" / "bundled_pair_h200_bf16.json"),
        help="cost file (default: the H200's, %(default)s)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument(
        "--budgets", type=int, nargs="+", default=[8, 32, 64], help="fixed budgets (default: %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="new tokens per request (default: %(default)s)"
    )
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=1,
        help="requests each slot runs in turn per run (1: one closed batch; budget_sweep.py's option)",
    )
    parser.add_argument(
        "--catch-up-ms",
        type=float,
        default=0.0,
        help="ms each newcomer's first draft (its prompt through the drafter) holds on top of the "
        "call's price (default: %(default)s; a rough reading of the H200's lockstep sweep at c = 64 "
        "gives ~0.5; bench/arrival_costs.py measures it)",
    )
    parser.add_argument(
        "--hit-spread",
        type=float,
        default=0.0,
        help="how much lower the drafter's hit rate may be on one slot's text than on another's "
        "(0 to 1; each slot's share is fixed: a closed batch then waits for its hardest text, as "
        "the bundled pair's sweep waits for one prompt; default: %(default)s)",
    )
    parser.add_argument(
        "--stand-in",
        choices=sorted(STAND_INS),
        default="classic",
        help="how well the stand-in drafter guesses (`StandIn`; `measured`: fitted to the bundled "
        "drafter's fixed budgets on an H100; default: %(default)s, the earlier results' stand-in)",
    )
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--warmup-runs", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per engine, median (default: %(default)s)"
    )
    add_variant_argument(parser)
    args = parser.parse_args(argv)
    if not Path(args.cost).is_file():
        parser.error(f"no cost file at {args.cost}")
    tokenizer = load_tokenizer(bundled_target_dir())
    made = engines(args, args.cost, tokenizer)
    # Request i's prompt, the same every run; each request decodes exactly --max-tokens.
    prompts = [[1 + (7 * i + j) % 50 for j in range(24)] for i in range(max(args.concurrency))]
    rows = []
    for concurrency in args.concurrency:
        rates: dict[str, list[float]] = {name: [] for name in made}
        for run in range(args.warmup_runs + args.repeats):
            for name, engine in made.items():  # round-robin: drift falls on all alike
                tag = f"{concurrency}-{run}"
                log, per_slot = StepLog(), args.requests_per_slot
                rate = tokens_per_s(engine, prompts, concurrency, args.max_tokens, tag, log, per_slot)
                if run >= args.warmup_runs:
                    rates[name].append(rate)
        rows.append({"concurrency": concurrency, **{n: statistics.median(r) for n, r in rates.items()}})
        print(row_line(rows[-1]), flush=True)
        for name in [variant_name(gate) for gate in [None, *args.variant]]:
            paired = paired_ratios(rows[-1], {**rates, "adaptive": rates[name]})
            print(f"  {name} / best, round by round: median {statistics.median(paired):.3f}", flush=True)
    print(markdown_table(rows, f"Fake device ({args.cost}), {args.max_tokens} new tokens"))


if __name__ == "__main__":
    main()
