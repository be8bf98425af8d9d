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
from ddtree_serve.models.cuda_graphs import BATCH_BUCKETS

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 8
"""Tokens of the scratch prompt each warm-up call prefills (`ModelCostProbe`'s): its verifies
read the first cache-row bucket."""

PROGRESS_EVERY_S = 5.0
"""Seconds between progress lines of a long warm-up (a large target's many shapes)."""


@dataclass(frozen=True)
class WarmupShapes:
    """What a warm-up runs: each verify at `batch_sizes` x `tree_nodes` (root included), and a
    draft at each of `draft_batch_sizes`."""

    batch_sizes: tuple[int, ...]
    tree_nodes: tuple[int, ...]
    draft_batch_sizes: tuple[int, ...]

    @property
    def num_calls(self) -> int:
        return len(self.batch_sizes) * len(self.tree_nodes) + len(self.draft_batch_sizes)


def warmup_shapes(
    token_buckets: tuple[int, ...], max_num_seqs: int, max_tree_tokens: int, drafts: bool
) -> WarmupShapes:
    """The shapes an engine's steps can meet, as the adaptive calibration runs them: the batch
    buckets below `max_num_seqs` and `max_num_seqs` itself (a full batch pads to its bucket; more
    requests than slots cannot run), and the tree-token buckets below `max_tree_tokens` and that
    width (a full tree pads to its bucket); a draft at each batch size when the engine `drafts`.
    Batches and trees past the largest bucket run eagerly and are left out."""
    batch_sizes = tuple(buckets_upto(BATCH_BUCKETS, min(max_num_seqs, BATCH_BUCKETS[-1])))
    tree_nodes = tuple(buckets_upto(token_buckets, min(max_tree_tokens, token_buckets[-1])))
    return WarmupShapes(batch_sizes, tree_nodes, batch_sizes if drafts else ())


def warm_up_graphs(target: Target, drafter: Drafter | None, shapes: WarmupShapes) -> float:
    """Runs every call of `shapes` once on scratch slots (each slot released after) and returns
    the seconds it took; logs what it captures, with progress lines on long warm-ups."""
    probe = ModelCostProbe(target, drafter, top_k=1, prompt_tokens=WARMUP_PROMPT_TOKENS)
    calls = [("verify", b, n) for b in shapes.batch_sizes for n in shapes.tree_nodes]
    calls += [("draft", b, 0) for b in shapes.draft_batch_sizes]
    logger.info(
        "capturing CUDA graphs: %d verify shapes (batch sizes %s, tree tokens %s) and %d draft batch sizes",
        len(shapes.batch_sizes) * len(shapes.tree_nodes),
        ",".join(map(str, shapes.batch_sizes)),
        ",".join(map(str, shapes.tree_nodes)),
        len(shapes.draft_batch_sizes),
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
    seconds = time.perf_counter() - started
    logger.info("captured CUDA graphs for %d shapes in %.1f s", len(calls), seconds)
    return seconds
