"""The real model pair on this CPU, on a device's clock: each forward takes what a cost file says.

`fake_device.py` replays a device's forward times over stand-in models, so its texts are
synthetic. The budget sweeps' open question on the GPUs rests on real texts (on an H100 one of
the eight bundled prompts sets every closed run's length at c >= 8), and on a CPU the real
forwards' times rank the budgets the other way. Here the real target and drafter compute every
draft and verdict, and the clock the engine, the policy and the bench read (`time.perf_counter`)
is moved so that each call took the cost file's time for its shape: a verify
`verify_ms(batch, batch x padded nodes)`, a prefill `verify_ms(prompts, prompt tokens)`, a draft
`draft_ms(batch)`. The host work between them (scheduling, tree builds, the adaptive policy)
keeps its real time on this CPU, and the host work a CUDA target runs while its device verifies
(`while_verifying`) runs within the forward's time, as it would there. So greedy outputs and
acceptance are the real pair's and the times are the device's forwards plus this host's Python:
a simulation of the GPU runs, not a measurement of them. Start-up calibrations time the same
calls, so an adaptive policy learns the cost file's curve. Verify graphs are modelled on request
(`--virtual-graph-capture-ms`): the target then reports the CUDA-graph tree-token buckets, so
the engine pads each verify to them as on a GPU, and a verify whose graph key (batch bucket,
tree-token bucket, cache-row bucket: `models.cuda_graphs.verify_bucket`) is met for the first
time takes that much longer (a capture: ~18 ms on the H200); every graphed verify, a fixed
budget's too, is priced at its bucket's padded batch and tree tokens, as the GPU runs it.
Prefills are priced unpadded and capture nothing (on a GPU they run the verify graphs too:
mostly warm-up time here). Without it no bucket padding.

    python bench/budget_sweep.py --virtual-cost bench/costs/bundled_pair_h100_bf16.json \\
        --concurrency 1,2,4,8,16 --max-tokens 64
"""

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import ddtree_serve.engine.spec_engine as spec_engine_module
import ddtree_serve.engine.tree_builder as tree_builder_module
from ddtree_serve.engine.budget import CostCurve, load_cost_curve
from ddtree_serve.engine.interfaces import (
    DraftInput,
    DraftOutput,
    PrefillInput,
    PrefillOutput,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.models.cuda_graphs import TOKEN_BUCKETS, verify_bucket

REAL_PERF_COUNTER = time.perf_counter  # as imported, before any `virtualize`


class VirtualClock:
    """`time.perf_counter` ahead of (or behind) the real one by what the priced calls did not take."""

    def __init__(self) -> None:
        self.real: Callable[[], float] = REAL_PERF_COUNTER
        self.offset = 0.0
        self.device_free_at = 0.0  # when the simulated device ends the draft it queued last

    def wait_for_device(self) -> None:
        """A call that needs the device's queued draft done (its top-K's copy, the next
        forward) starts no earlier than that."""
        self.offset += max(self.device_free_at - self(), 0.0)

    def __call__(self) -> float:
        return self.real() + self.offset

    def charge(self, started: float, seconds: float) -> None:
        """The call that began at real time `started` took `seconds` on the clock, however long
        it took here."""
        self.offset += seconds - (self.real() - started)


class VirtualTarget:
    """A target step whose prefills and verifies take the cost file's time on `clock`; with
    `capture_ms`, a graphed one's: it reports the CUDA-graph tree-token buckets, and the first
    verify of each graph key takes `capture_ms` more."""

    def __init__(self, inner, cost: CostCurve, clock: VirtualClock, capture_ms: float | None = None) -> None:
        self.inner, self.cost, self.clock, self.capture_ms = inner, cost, clock, capture_ms
        # Set by the engine (an adaptive policy's lessons): run within the verify's time.
        self.while_verifying: Callable[[], None] | None = None
        self.captured: set[tuple[int, int, int]] = set()  # graph keys met (with `capture_ms`)

    @property
    def verify_token_buckets(self) -> tuple[int, ...] | None:
        return None if self.capture_ms is None else TOKEN_BUCKETS

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        self.clock.wait_for_device()
        started = self.clock.real()
        output = self.inner.prefill(inputs)
        tokens = sum(len(p) for p in inputs.prompts)
        self.clock.charge(started, float(self.cost.verify_ms(len(inputs.prompts), tokens)) / 1000.0)
        return output

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        self.clock.wait_for_device()
        started = self.clock.real()
        if self.while_verifying is not None:
            self.while_verifying()
        hidden = self.clock.real() - started
        output = self.inner.verify_and_commit(inputs)
        batch = inputs.batch
        batch_size, num_nodes, capture_ms = batch.batch_size, batch.padded_num_nodes, 0.0
        key = self._graph_key(inputs, output)
        if key is not None:  # a graphed verify runs its bucket's padded shape
            batch_size, num_nodes = key[0], key[1]
            if key not in self.captured:
                self.captured.add(key)
                capture_ms = self.capture_ms or 0.0
        forward_ms = float(self.cost.verify_ms(batch_size, batch_size * num_nodes))
        self.clock.charge(started, max(forward_ms / 1000.0, hidden) + capture_ms / 1000.0)
        return output

    def _graph_key(self, inputs: VerifyInput, output: VerifyOutput) -> tuple[int, int, int] | None:
        """The graph this verify ran (`models.cuda_graphs.verify_bucket`; None without
        `capture_ms`, or eager); the longest context it read is its slots' cache before the
        commit, which adds each request's root and accepted nodes."""
        if self.capture_ms is None:
            return None
        committed = (output.accept_len + 1).tolist()
        max_start = max(n - k for n, k in zip(output.num_cached_tokens, committed, strict=True))
        batch = inputs.batch
        return verify_bucket(batch.batch_size, batch.padded_num_nodes, max_start, self.inner.max_seq_len)


class VirtualDrafter:
    """A draft step whose drafts take the cost file's time on `clock`; with `launch_ms`, as a
    device's: the call returns after its launch, and the device ends the draft the file's time
    after the call began (the top-K's copy and the next forward wait for it)."""

    def __init__(self, inner, cost: CostCurve, clock: VirtualClock, launch_ms: float | None = None) -> None:
        self.inner, self.cost, self.clock, self.launch_ms = inner, cost, clock, launch_ms

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def draft(self, inputs: DraftInput) -> DraftOutput:
        self.clock.wait_for_device()
        began, started = self.clock(), self.clock.real()
        output = self.inner.draft(inputs)
        draft_ms = self.cost.draft_ms(len(inputs.slots))
        if self.launch_ms is None:
            self.clock.charge(started, draft_ms / 1000.0)
        else:
            self.clock.charge(started, min(self.launch_ms, draft_ms) / 1000.0)
            self.clock.device_free_at = began + draft_ms / 1000.0
        return output


def virtualize(
    target, drafter, cost_path: Path, draft_launch_ms: float | None = None, capture_ms: float | None = None
) -> tuple[VirtualTarget, VirtualDrafter]:
    """The pair on the cost file's clock, which from now on is `time.perf_counter` for every
    module that calls it through `time` (the engine, the policy, the benches).

    `draft_launch_ms`: drafts run as a device's, asynchronous (`VirtualDrafter`): the engine
    takes them for device drafts (`spec_engine.draft_on_device`), and the top-K's copy to the
    host waits for the device's draft to end, as on a GPU (on the H200 the drafter call's launch
    took 0.29 ms at batch 1-2, `bench/step_stages.py`).
    `capture_ms`: the target is a graphed one's, each first verify of a graph key that much
    longer (`VirtualTarget`)."""
    cost, clock = load_cost_curve(cost_path), VirtualClock()
    time.perf_counter = clock
    if draft_launch_ms is not None:

        def on_host(logp, ids, copy=tree_builder_module.topk_on_host):
            clock.wait_for_device()
            return copy(logp, ids)

        spec_engine_module.topk_on_host = tree_builder_module.topk_on_host = on_host
        spec_engine_module.draft_on_device = lambda draft: True
    virtual_target = VirtualTarget(target, cost, clock, capture_ms)
    return virtual_target, VirtualDrafter(drafter, cost, clock, draft_launch_ms)


def add_virtual_arguments(parser: argparse.ArgumentParser) -> None:
    """The virtual device's options (`virtualize_from_args` reads them), for every bench that runs
    the pair on a cost file's clock."""
    parser.add_argument(
        "--virtual-cost",
        type=Path,
        default=None,
        help="a device's cost file: the real pair runs here, each forward taking the file's time "
        "on the clock every timer reads (`virtual_device.py`; a simulation of that device, with "
        "this host's work)",
    )
    parser.add_argument(
        "--virtual-draft-launch-ms",
        type=float,
        default=None,
        help="with --virtual-cost: drafts run asynchronously, as a device's, the drafter call "
        "returning after this many ms and the top-K's copy waiting for the draft's end "
        "(the H200's launch: 0.29) (default: synchronous drafts)",
    )
    parser.add_argument(
        "--virtual-graph-capture-ms",
        type=float,
        default=None,
        help="with --virtual-cost: the target is a CUDA-graphed one's (verifies padded to the graph "
        "buckets), and the first verify of each graph key takes this many ms more (the H200: "
        "~18) (default: no graphs)",
    )


def virtualize_from_args(target, drafter, args: argparse.Namespace):
    """The pair as `add_virtual_arguments`' options say: on the cost file's clock
    (`virtualize`) when `--virtual-cost` is given, else as it is."""
    if args.virtual_cost is None:
        return target, drafter
    return virtualize(
        target, drafter, args.virtual_cost, args.virtual_draft_launch_ms, args.virtual_graph_capture_ms
    )
