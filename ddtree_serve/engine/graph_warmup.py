"""Capture a graphed target's verify graphs and the drafter's block graphs before serving.

A graphed target captures one CUDA graph per (batch bucket, tree-token bucket, cache-row
bucket) the first time a call meets it (`models.cuda_graphs`), ~18 ms each on the H200, five
steps of the bundled pair; the drafter captures its block forward per batch bucket. A fixed
budget's steps meet a new tree width or batch bucket again and again in their first minutes
of traffic (the trees pad to the bucket of their widest, which varies step to step), and each
first meeting held every request of that step for the capture. So the engine runs one verify
per (batch bucket, tree-token bucket) its steps can meet and one draft per batch bucket at
start-up, as vLLM captures its decode graphs, on scratch slots it leaves empty
(`ModelCostProbe`). Contexts past the first cache-row bucket, and the drafter's appends of
other lengths, still capture when first met. The adaptive policy's start-up calibration runs
over the same shapes, so a policy calibrated at start-up needs no warm-up; one read from a cost
file, or kept over a restarted target (whose graphs died with it), does.
"""

import logging
import time
from dataclasses import dataclass

from ddtree_serve.engine.budget.measure import ModelCostProbe, buckets_upto
from ddtree_serve.engine.interfaces import Drafter, Target
from ddtree_serve.models.cuda_graphs import BATCH_BUCKETS, pick_bucket

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 8
"""Tokens of the scratch prompt each warm-up call prefills (`ModelCostProbe`'s): its verifies
read the first cache-row bucket."""

PROGRESS_EVERY_S = 5.0
"""Seconds between progress lines of a long warm-up (a large target's many shapes)."""

MAX_WARMUP_LOGITS_GIB = 8.0
"""The most logits memory the warm-up's verify graphs may hold together. Each graph keeps its
`[batch, nodes, vocab]` logits; every shape of the bundled pair (8192-token vocabulary, batches
to 64, budget 64) held 2.4 GiB on the H200, but a 150k vocabulary at those limits would hold
tens of GB at start-up where a lightly loaded server never meets most of them. Past the cap the
largest shapes are left to capture when first met, as before the warm-up."""

LOGITS_BYTES_PER_VALUE = 2
"""Bytes of one logit in a graph's output (the bf16 / fp16 models a GPU serves)."""


@dataclass(frozen=True)
class WarmupShapes:
    """What a warm-up runs: a verify of each `(batch size, tree nodes)` of `verifies` (root
    included), smallest first, and a draft at each of `draft_batch_sizes`; `left_out`: the
    verify shapes past the logits cap, and `left_out_gib` their logits."""

    verifies: tuple[tuple[int, int], ...]
    draft_batch_sizes: tuple[int, ...]
    left_out: int = 0
    left_out_gib: float = 0.0

    @property
    def num_calls(self) -> int:
        return len(self.verifies) + len(self.draft_batch_sizes)


def warmup_shapes(
    token_buckets: tuple[int, ...],
    max_num_seqs: int,
    max_tree_tokens: int,
    drafts: bool,
    vocab_size: int,
    max_logits_gib: float = MAX_WARMUP_LOGITS_GIB,
) -> WarmupShapes:
    """The shapes an engine's steps can meet, as the adaptive calibration runs them: the batch
    buckets below `max_num_seqs` and `max_num_seqs` itself (a full batch pads to its bucket; more
    requests than slots cannot run), times the tree-token buckets below `max_tree_tokens` and that
    width (a full tree pads to its bucket); a draft at each batch size when the engine `drafts`.
    Batches and trees past the largest bucket run eagerly and are left out, and so are the
    largest verify shapes once their graphs' logits (`vocab_size` each node) would pass
    `max_logits_gib` together (`MAX_WARMUP_LOGITS_GIB`)."""
    batch_sizes = buckets_upto(BATCH_BUCKETS, min(max_num_seqs, BATCH_BUCKETS[-1]))
    tree_nodes = buckets_upto(token_buckets, min(max_tree_tokens, token_buckets[-1]))

    def logits_gib(shape: tuple[int, int]) -> float:
        padded_batch = pick_bucket(shape[0], BATCH_BUCKETS) or shape[0]
        padded_nodes = pick_bucket(shape[1], token_buckets) or shape[1]
        return padded_batch * padded_nodes * vocab_size * LOGITS_BYTES_PER_VALUE / 2**30

    ordered = sorted(((b, n) for b in batch_sizes for n in tree_nodes), key=lambda s: (s[0] * s[1], s))
    verifies: list[tuple[int, int]] = []
    held_gib = 0.0
    for shape in ordered:
        if held_gib + logits_gib(shape) > max_logits_gib:
            break
        verifies.append(shape)
        held_gib += logits_gib(shape)
    left_out = ordered[len(verifies) :]
    return WarmupShapes(
        tuple(verifies),
        tuple(batch_sizes) if drafts else (),
        left_out=len(left_out),
        left_out_gib=sum(map(logits_gib, left_out)),
    )


def warm_up_graphs(target: Target, drafter: Drafter | None, shapes: WarmupShapes) -> None:
    """Runs every call of `shapes` once on scratch slots (each slot released after); logs what it
    captures and in how long, with progress lines on long warm-ups."""
    probe = ModelCostProbe(target, drafter, top_k=1, prompt_tokens=WARMUP_PROMPT_TOKENS)
    calls = [("verify", b, n) for b, n in shapes.verifies]
    calls += [("draft", b, 0) for b in shapes.draft_batch_sizes]
    logger.info(
        "capturing CUDA graphs: %d verify shapes (batch sizes %s, tree tokens %s) and %d draft batch sizes",
        len(shapes.verifies),
        ",".join(map(str, sorted({b for b, _ in shapes.verifies}))),
        ",".join(map(str, sorted({n for _, n in shapes.verifies}))),
        len(shapes.draft_batch_sizes),
    )
    if shapes.left_out:
        logger.info(
            "%d larger verify shapes (%.1f GiB of logits, past the warm-up's cap) capture when first met",
            shapes.left_out,
            shapes.left_out_gib,
        )
    started = last_report = time.perf_counter()
    for done, (kind, batch_size, nodes) in enumerate(calls, start=1):
        if kind == "verify":
            probe.verify_ms(batch_size, nodes)
        else:
            probe.draft_ms(batch_size)
        now = time.perf_counter()
        if now - last_report >= PROGRESS_EVERY_S and done < len(calls):
            logger.info("capturing CUDA graphs: %d/%d shapes, %.1f s", done, len(calls), now - started)
            last_report = now
    logger.info("captured CUDA graphs for %d shapes in %.1f s", len(calls), time.perf_counter() - started)
