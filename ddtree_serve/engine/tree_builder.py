"""The build stage: each request's draft top-K -> the padded `VerifyBatch` of the step.

Two places to build, one result (the device builder is tested equal to the host one):
  - host (the default): `build_host_tree_batch` (the heap builder per request, or all requests'
    heaps in lockstep at large batches), then `TreeBatch.verify_batch`. A CPU and the Ray
    transport (the coordinator holds CPU tensors) build here;
  - device: `build_ddtree_batch` for the whole batch where the draft lies (a chain is K = 1
    with budget L), on CUDA replayed from a CUDA graph per (batch bucket, L, K, budget_max),
    so between the draft forward and the verify forward nothing waits for the host and the
    step syncs once.
Measured on the H200 with the bundled pair (bf16, graphs), the device build costs more than
the host one plus its copy at every budget and batch: build stage 1.0-2.4 ms against 0.25-0.5
ms at batch 1, 1.1-3.9 ms against 0.4-2.3 ms at batch 16 (its ~500 small kernels run one
after another even in a graph), so the host build is the default on CUDA too.
Mode "ar" has no draft: its root-only trees are built on the host (they are tiny).
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ddtree_serve.models.cuda_graphs import BATCH_BUCKETS, StaticForward, new_graph_pool, pick_bucket
from ddtree_serve.tree import (
    TreeBatch,
    VerifyBatch,
    build_chain,
    build_ddtree,
    build_ddtree_batch,
    build_ddtrees,
    lockstep_pays,
    num_device_tree_nodes,
)

TreePlacement = Literal["host", "device"]
"""Where trees are built: "device" = where the draft lies (CUDA or, in tests, the CPU)."""


@dataclass(frozen=True)
class BuiltTrees:
    """One step's trees: the verify batch (on the host or the draft's device) and, on the host,
    each tree's node count (root included), for drawing the sampling coins without a sync."""

    batch: VerifyBatch
    num_nodes: list[int]
    host: TreeBatch | None = None  # the host trees, when built on the host


class TreeBuilder:
    """Builds the step's trees where `placement` says; `capture`: CUDA graphs for the device build."""

    def __init__(self, placement: TreePlacement = "host", capture: bool = True) -> None:
        self.placement = placement
        self.capture = capture
        self._graphs: DeviceTreeGraphs | None = None

    def build(
        self,
        logp: torch.Tensor | None,
        ids: torch.Tensor | None,
        budgets: Sequence[int],
        root_tokens: Sequence[int],
        chain: bool,
    ) -> BuiltTrees:
        """Trees from the draft's `logp`, `ids` [B, L, K] (None: no draft, root-only trees).

        `budgets[b]`: request b's draft nodes (ignored for a chain, which takes all L);
        `root_tokens[b]`: its bonus token. Request b uses its first min(budget, K) ranks.
        """
        if logp is None or ids is None:
            trees = TreeBatch.root_only(root_tokens)
            return BuiltTrees(trees.verify_batch(), [1] * trees.batch_size, trees)
        if self.placement == "device":
            return self._build_on_device(logp, ids, budgets, root_tokens, chain)
        return _build_on_host(logp, ids, budgets, root_tokens, chain)

    def _build_on_device(
        self,
        logp: torch.Tensor,
        ids: torch.Tensor,
        budgets: Sequence[int],
        root_tokens: Sequence[int],
        chain: bool,
    ) -> BuiltTrees:
        num_positions = logp.shape[1]
        if chain:
            logp, ids, budgets = logp[:, :, :1], ids[:, :, :1], [num_positions] * len(root_tokens)
        budget_max = max(budgets)
        num_ranks = logp.shape[2]
        num_nodes = [
            num_device_tree_nodes(budget, num_positions, num_ranks, budget_max) for budget in budgets
        ]
        if logp.is_cuda and self.capture:
            if self._graphs is None:
                self._graphs = DeviceTreeGraphs(logp.device)
            batch = self._graphs.build(logp, ids, budgets, root_tokens, budget_max)
            if batch is not None:
                return BuiltTrees(batch, num_nodes)
        host = torch.tensor([list(budgets), list(root_tokens)], dtype=torch.int64)
        budgets_t, roots_t = host.to(logp.device, non_blocking=True)
        return BuiltTrees(build_ddtree_batch(logp, ids, budgets_t, roots_t, budget_max).verify, num_nodes)


def _build_on_host(
    logp: torch.Tensor, ids: torch.Tensor, budgets: Sequence[int], root_tokens: Sequence[int], chain: bool
) -> BuiltTrees:
    trees = build_host_tree_batch(logp, ids, budgets, root_tokens, chain=chain)
    return BuiltTrees(trees.verify_batch(), trees.num_nodes.tolist(), trees)


def build_host_tree_batch(
    logp: torch.Tensor,
    ids: torch.Tensor,
    budgets: Sequence[int],
    root_tokens: Sequence[int],
    chain: bool = False,
) -> TreeBatch:
    """Every request's host tree from the draft's `logp`, `ids` [B, L, K] (any device): row b is
    `build_ddtree(logp[b, :, :budgets[b]], ...)` (a chain: `build_chain` of rank 0)."""
    logp, ids = topk_on_host(logp, ids)
    logp_np, ids_np = logp.numpy(), ids.numpy()
    if chain:
        return TreeBatch.from_trees(
            [build_chain(ids_np[b, :, 0], root, logp_np[b, :, 0]) for b, root in enumerate(root_tokens)]
        )
    if budgets and lockstep_pays(sum(budgets), max(budgets)):
        return build_ddtrees(logp_np, ids_np, budgets, root_tokens)
    return TreeBatch.from_trees(
        [
            build_ddtree(logp_np[b, :, :budget], ids_np[b, :, :budget], budget, root)
            for b, (budget, root) in enumerate(zip(budgets, root_tokens, strict=True))
        ]
    )


def topk_on_host(logp: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's top-K on the host (float32 log-probs, int64 ids) in one copy; waits for the
    drafter's kernels when they are still running."""
    on_host = logp.device.type == "cpu" and ids.device.type == "cpu"
    if on_host and logp.dtype == torch.float32 and ids.dtype == torch.int64:
        return logp, ids
    packed = torch.cat([logp.float(), ids.to(torch.float32)], dim=-1).cpu()  # one copy; ids < 2^24
    num_ranks = logp.shape[-1]
    return packed[..., :num_ranks], packed[..., num_ranks:].long()


@dataclass
class TreeInputs:
    """Static inputs of one (batch bucket, L, K, budget_max) build graph."""

    logp: torch.Tensor  # [Bb, L, K] float32; padded rows hold any finite descending values
    ids: torch.Tensor  # [Bb, L, K] int64
    budgets_and_roots: torch.Tensor  # [2, Bb] int64; padded rows: budget 0 (root alone)
    budget_max: int


class DeviceTreeGraphs:
    """`build_ddtree_batch` replayed from CUDA graphs, the batch padded to a batch bucket."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.forward = StaticForward(
            self._new_inputs, self._forward, capture=True, pool=new_graph_pool(device, True)
        )

    @torch.inference_mode()
    def build(
        self,
        logp: torch.Tensor,
        ids: torch.Tensor,
        budgets: Sequence[int],
        root_tokens: Sequence[int],
        budget_max: int,
    ) -> VerifyBatch | None:
        """The step's `VerifyBatch` as views of the graph's outputs (valid until the next build),
        or None when the batch has no bucket."""
        batch_size, num_positions, num_ranks = logp.shape
        padded_batch = pick_bucket(batch_size, BATCH_BUCKETS)
        if padded_batch is None:
            return None

        def fill(inputs: TreeInputs) -> None:
            padding = padded_batch - batch_size
            host = torch.tensor([[*budgets, *[0] * padding], [*root_tokens, *[0] * padding]])
            inputs.budgets_and_roots.copy_(host, non_blocking=True)
            inputs.logp[:batch_size] = logp
            inputs.ids[:batch_size] = ids

        key = (padded_batch, num_positions, num_ranks, budget_max)
        outputs = [t[:batch_size] for t in self.forward.run(key, fill)]
        tokens, depths, parents, index, next_token, next_sibling, mask, num_nodes = outputs
        return VerifyBatch(
            tokens=tokens,
            depths=depths,
            parents=parents,
            retrieve_index=index,
            retrieve_next_token=next_token,
            retrieve_next_sibling=next_sibling,
            attn_mask=mask,
            num_nodes=num_nodes,
            max_depth=min(num_positions, budget_max) if num_ranks else 0,
        )

    def _new_inputs(self, key: Hashable) -> TreeInputs:
        padded_batch, num_positions, num_ranks, budget_max = key  # type: ignore[misc]
        shape = (padded_batch, num_positions, num_ranks)
        return TreeInputs(
            logp=torch.zeros(shape, dtype=torch.float32, device=self.device),
            ids=torch.zeros(shape, dtype=torch.int64, device=self.device),
            budgets_and_roots=torch.zeros(2, padded_batch, dtype=torch.int64, device=self.device),
            budget_max=budget_max,
        )

    def _forward(self, inputs: TreeInputs) -> tuple[torch.Tensor, ...]:
        budgets, roots = inputs.budgets_and_roots
        verify = build_ddtree_batch(inputs.logp, inputs.ids, budgets, roots, inputs.budget_max).verify
        return (
            verify.tokens,
            verify.depths,
            verify.parents,
            verify.retrieve_index,
            verify.retrieve_next_token,
            verify.retrieve_next_sibling,
            verify.attn_mask,
            verify.num_nodes,
        )
