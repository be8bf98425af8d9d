"""The per-step actor hops as one step graph: a Ray Compiled Graph (`placement.transport:
compiled_graph`) or the same graph over the group's own sockets (`sockets`, `step_sockets.py`).

A normal actor call costs a task submission, a scheduling round and an object-store result
per call; the step makes two or three of them. A compiled graph is set up once over the two
actors and then moves each execution's inputs and outputs through shared-memory channels
(`bench/hop_breakdown.py` measures both). One graph serves every call of the step:

    serial (placement.overlap off):
    step[1] -> target.graph_call -> output -----------------------------------> target output
                                 -> context -> drafter.graph_take_context ----> draft output
    step[0] -------------------------------------------^

    overlap:
    step[0] -> drafter.graph_draft -------------------------------------------> draft output
    step[1] -> target.graph_call -> output -----------------------------------> target output
                                 -> context -> drafter.graph_take_context ----> (None)

so the target's features reach the drafter inside the graph and the Coordinator holds only a
`GraphContext` marker. An execution carries a drafter call, a target call, or both. In the
serial shape the drafter has one node, so an execution moves no more values than it uses; with
`placement.chain_drafts` the serial step pairs its verify with the chained draft of the same
requests' next block, which the drafter runs as soon as it has the verdict's bonus tokens and
features: a steady step is then one execution (one round trip) instead of two. The overlapped
step pairs the draft of one micro-batch with the verify of
the other, which the two actors run at the same time: its drafter call has a node of its own
that does not wait for the target. Ray 2.60 allows an actor in one compiled graph only, hence
one graph for all of it; released slots travel with the next execution (`graph_calls.py`).

Faults: a dead drafter breaks the graph. It is torn down (the actors live on), the target's
call of the broken execution is replayed from the target's last result (or run, if it never
ran), and target calls go as plain actor calls (or run here, for a target in this process:
`local_target.py`) while `GraphDrafter.is_available` waits for Ray to restart the drafter; then
the graph is compiled again and the engine rebuilds the drafter's context
(`SpecEngine._restore_drafter`). A dead (or restarted) target is `TargetUnavailableError`; the
Coordinator's new engine after a target restart compiles a new graph (`discard` drops the old
one).
"""

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

import ray
import torch
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import RayActorError, RayChannelError

from ddtree_serve.engine.interfaces import (
    ContextHandle,
    DrafterUnavailableError,
    DraftInput,
    DraftOutput,
    EncodeInput,
    Pending,
    PrefillInput,
    PrefillOutput,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.serve.graph_calls import DrafterCall, GraphContext, TargetCall, TargetMethod
from ddtree_serve.serve.local_target import LocalTarget
from ddtree_serve.serve.step_sockets import SocketGraph, StepChannelError
from ddtree_serve.serve.wire import from_wire, to_wire
from ddtree_serve.serve.workers import RayDrafter, RayTarget, TargetRestartedError, target_lost

logger = logging.getLogger(__name__)

ResultT = TypeVar("ResultT")

# Longest one execution may take (a long prompt's prefill on a big model); Ray's default is 10 s.
_GET_TIMEOUT_S = 600.0
# What a step graph raises when an actor in it is gone.
_LOST = (RayChannelError, RayActorError, StepChannelError)
GraphTransport = Literal["compiled_graph", "sockets"]


@dataclasses.dataclass
class _Execution:
    """One graph execution being filled, then its results (wired) or each side's error."""

    draft: DrafterCall | None = None
    target: TargetCall | None = None
    chained: DrafterCall | None = None  # a draft after the target's verify, from its results
    done: bool = False
    draft_result: Any = None  # unwired
    target_result: Any = None
    chained_result: Any = None
    draft_error: Exception | None = None
    target_error: Exception | None = None
    chained_error: Exception | None = None


class _GraphPending(Generic[ResultT]):
    """One side of an execution: `result()` runs the execution if it has not run yet."""

    def __init__(self, graph: "StepGraph", execution: _Execution, role: str, finish: Any) -> None:
        self._graph = graph
        self._execution = execution
        self._role = role
        self._finish = finish

    def result(self) -> ResultT:
        if not self._execution.done:
            self._graph.flush()
        error = getattr(self._execution, f"{self._role}_error")
        if error is not None:
            raise error
        return self._finish(getattr(self._execution, f"{self._role}_result"))


class StepGraph:
    """The compiled graph over one group's drafter and target actors, and its calls in order.

    Calls queue into the open execution; a second call for the same side (a chained draft: any
    open call), or any `result()`, runs it first. Not thread-safe: the engine thread drives it.
    """

    def __init__(
        self,
        target: RayTarget | LocalTarget,
        drafter: RayDrafter,
        overlap: bool,
        transport: GraphTransport = "compiled_graph",
    ) -> None:
        """`overlap`: the graph's shape for the overlapped step (the drafter's call does not wait
        for the target's); else the serial shape. An overlapped engine runs correctly on the
        serial shape (its two calls then do not run at once); chained drafts need the serial one.
        `transport`: Ray's compiled graph, or the same graph over the workers' sockets (the only
        one for a `LocalTarget`: its calls run in this process, unwired)."""
        if isinstance(target, LocalTarget) and transport != "sockets":
            raise ValueError("a target in the Coordinator's process needs the socket step graph")
        self._target = target
        self._local_target = target if isinstance(target, LocalTarget) else None
        self._drafter = drafter
        self._overlap = overlap
        self.transport = transport
        self._open = _Execution()
        self._call_ids = iter(range(1 << 62))
        self._target_releases: list[int] = []
        self._drafter_releases: list[int] = []
        self._graph: Any = None
        # Host work for the next execution's wait (`GraphTarget.while_verifying`): run once,
        # after the execution is sent and before its results are read.
        self.while_running: Callable[[], None] | None = None
        self._compile()

    @property
    def compiled(self) -> bool:
        """False after the drafter was lost, until `recompile`."""
        return self._graph is not None

    def _compile(self) -> None:
        drafter = self._drafter.actor
        if self._local_target is not None:
            self._graph = SocketGraph(self._local_target.step_end(self._overlap), drafter, self._overlap)
            return
        target = self._target.actor
        if self.transport == "sockets":
            self._graph = SocketGraph(target, drafter, self._overlap)
            return
        with InputNode() as step:
            if self._overlap:
                draft = drafter.graph_draft.bind(step[0])
                output, context = target.graph_call.options(num_returns=2).bind(step[1])
                dag = MultiOutputNode([draft, output, drafter.graph_take_context.bind(context, None)])
            else:
                output, context = target.graph_call.options(num_returns=2).bind(step[1])
                dag = MultiOutputNode([output, drafter.graph_take_context.bind(context, step[0])])
        self._graph = dag.experimental_compile()

    def recompile(self) -> None:
        """Compile again over the (restarted) drafter; its context starts empty."""
        self._drafter_releases.clear()
        self._compile()
        logger.warning("step graph (%s) rebuilt over the restarted drafter", self.transport)

    def discard(self) -> None:
        """Tear the graph down without running what is queued: its target restarted, and the
        engine that queued it is gone."""
        self._target_releases.clear()
        self._drafter_releases.clear()
        if self._graph is not None:
            _teardown(self._graph)
            self._graph = None

    def close(self) -> None:
        """Run the releases still queued, then tear the graph down; the actors live on.

        An idle compiled graph's actors poll their channels, a CPU core each: close a graph
        that will not run again."""
        if self._target_releases or self._drafter_releases:
            self.flush()
        if self._graph is not None:
            self._graph.teardown()
            self._graph = None

    # ------------------------------------------------------------------------------- calls

    def submit_target(self, method: TargetMethod, inputs: Any, finish: Any) -> Pending[Any]:
        if self._open.target is not None:
            self.flush()
        self._open.target = TargetCall(next(self._call_ids), (), method, self._target_inputs(inputs))
        return _GraphPending(self, self._open, "target", finish)

    def _target_inputs(self, inputs: Any) -> Any:
        """A target call's inputs as its target takes them: wired for an actor."""
        return inputs if self._local_target is not None else to_wire(inputs)

    def submit_verify_then_draft(
        self, inputs: VerifyInput, top_k: int, finish: Any
    ) -> tuple[Pending[VerifyOutput], Pending[DraftOutput]]:
        """The verify and the chained draft of its slots, in one execution (see the module doc)."""
        if self._overlap:
            raise ValueError("chained drafts need the serial graph (placement.overlap off)")
        if self._open.target is not None or self._open.draft is not None:
            self.flush()
        wired = self._target_inputs(inputs)
        self._open.target = TargetCall(next(self._call_ids), (), "verify_and_commit", wired)
        # The drafter takes each slot's roots from the verdict and its one new context slice from
        # the delivery: the bonus tokens here only give the call its shape.
        slots = list(inputs.slots)
        draft = DraftInput(slots, torch.zeros(len(slots), dtype=torch.int64), (), top_k)
        self._open.chained = DrafterCall((), to_wire(draft), (1,) * len(slots), chained=True)
        execution = self._open
        return _GraphPending(self, execution, "target", finish), _GraphPending(
            self, execution, "chained", lambda output: output
        )

    def submit_draft(self, inputs: DraftInput) -> Pending[DraftOutput]:
        if self._open.draft is not None:
            self.flush()
        # The graph delivered the features already: the slices (GraphContext markers) only count.
        counts = tuple(len(slices) for slices in inputs.contexts)
        self._open.draft = DrafterCall((), to_wire(dataclasses.replace(inputs, contexts=())), counts)
        return _GraphPending(self, self._open, "draft", lambda output: output)

    def release_target(self, slot: int) -> None:
        self._target_releases.append(slot)

    def release_drafter(self, slot: int) -> None:
        if self.compiled:
            self._drafter_releases.append(slot)  # a lost drafter comes back with no slots held

    def flush(self) -> None:
        """Run the open execution (with the releases queued since the last one)."""
        execution, self._open = self._open, _Execution()
        if execution.target is not None or self._target_releases:
            call = execution.target or TargetCall(next(self._call_ids), (), None, None)
            execution.target = dataclasses.replace(call, releases=tuple(self._target_releases))
            self._target_releases.clear()
        if execution.draft is not None or self._drafter_releases:
            call = execution.draft or DrafterCall((), None)
            execution.draft = dataclasses.replace(call, releases=tuple(self._drafter_releases))
            self._drafter_releases.clear()
        if self.compiled:
            self._run_compiled(execution)
        else:
            self._run_plain(execution)
        execution.done = True

    def _run_compiled(self, execution: _Execution) -> None:
        try:
            # A graph whose actor died may already refuse the write (its channel closed).
            if self._overlap:
                draft_ref, target_ref, after_ref = self._graph.execute(execution.draft, execution.target)
                refs = [("draft", draft_ref), ("target", target_ref), (None, after_ref)]
            else:
                drafter_call = _one_drafter_call(execution)
                target_ref, drafter_ref = self._graph.execute(drafter_call, execution.target)
                role = "chained" if execution.chained is not None else "draft"
                refs = [("target", target_ref), (role, drafter_ref)]
            self._run_while_waiting()
            # Ray's channel values are views of the channel's buffer, which the next execution
            # cannot write while one lives (a carried draft outlives a step): copied out. A
            # socket reply's buffer is its own, read fresh for each message.
            copy = self.transport == "compiled_graph"
            for role, ref in refs:
                value = ref.get(timeout=_GET_TIMEOUT_S)
                if role != "target" or self._local_target is None:
                    value = from_wire(value, copy=copy)
                if role is not None:
                    setattr(execution, f"{role}_result", value)
        except _LOST as error:
            self._break(execution, error)
        except TargetRestartedError as error:  # compiled over a target that restarted since
            execution.target_error = target_lost(error)

    def _run_while_waiting(self) -> None:
        hook, self.while_running = self.while_running, None
        if hook is not None:
            hook()

    def _break(self, execution: _Execution, error: Exception) -> None:
        """An actor of the graph is gone: tear it down, tell which one, save the target's call."""
        logger.warning("step graph (%s) broke (%s); tearing it down", self.transport, type(error).__name__)
        _teardown(self._graph)
        self._graph = None
        self._drafter_releases.clear()
        execution.draft_result = execution.chained_result = None
        execution.draft_error = DrafterUnavailableError(f"the drafter left the step graph ({error!r})")
        execution.chained_error = execution.draft_error
        if execution.target is not None:
            self._run_plain_target(execution)

    def _run_plain(self, execution: _Execution) -> None:
        """While the drafter is lost: the target's call without the graph, no draft."""
        lost = DrafterUnavailableError("the drafter is lost; the graph waits for it")
        if execution.draft is not None and execution.draft.inputs is not None:
            execution.draft_error = lost
        if execution.chained is not None:
            execution.chained_error = lost
        if execution.target is not None:
            self._run_plain_target(execution)

    def _run_plain_target(self, execution: _Execution) -> None:
        """The target's call as a plain actor call (or here, for a target in this process): its
        result kept from the broken execution, or run now (without features: no drafter takes
        them)."""
        assert execution.target is not None
        if self._local_target is not None:
            execution.target_result = self._local_target.calls.replay(execution.target)
            self._run_while_waiting()  # the engine's verify hook runs once a verify, as below
            return
        ref = self._target.actor.replay_graph_call.remote(execution.target)
        self._run_while_waiting()
        try:
            execution.target_result = from_wire(ray.get(ref))
        except (RayActorError, TargetRestartedError) as error:
            execution.target_error = target_lost(error)


class GraphTarget:
    """`Target` (and `PipelinedTarget`, `DraftChainingTarget`) over the step graph; metadata from
    the `RayTarget` (or the `LocalTarget`)."""

    def __init__(self, graph: StepGraph, target: RayTarget | LocalTarget) -> None:
        self._graph = graph
        self._target = target
        # `AsyncDeviceTarget`: the engine's host work while the workers run the verify's
        # execution (it is handed to the graph for that one execution).
        self.while_verifying: Callable[[], None] | None = None

    @property
    def vocab_size(self) -> int:
        return self._target.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._target.eos_token_ids

    @property
    def max_seq_len(self) -> int:
        return self._target.max_seq_len

    @property
    def actor(self) -> Any:
        return self._target.actor

    @property
    def transport(self) -> GraphTransport:
        return self._graph.transport

    async def check_alive(self) -> None:
        await self._target.check_alive()

    @property
    def verify_token_buckets(self) -> tuple[int, ...] | None:
        return self._target.verify_token_buckets

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        context = GraphContext(0)
        pending = self._graph.submit_target(
            "prefill", inputs, lambda output: dataclasses.replace(output, context=context)
        )
        return pending.result()

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        pending = self.submit_verify(inputs)
        self._graph.while_running = self.while_verifying
        try:
            return pending.result()
        finally:
            self._graph.while_running = None

    def submit_verify(self, inputs: VerifyInput) -> Pending[VerifyOutput]:
        context = GraphContext(0) if inputs.return_context else None
        return self._graph.submit_target(
            "verify_and_commit", inputs, lambda output: dataclasses.replace(output, context=context)
        )

    def submit_verify_then_draft(
        self, inputs: VerifyInput, top_k: int
    ) -> tuple[Pending[VerifyOutput], Pending[DraftOutput]]:
        """`DraftChainingTarget`: the verdict's features went to the drafter's chained draft."""
        if not inputs.return_context:
            raise ValueError("a chained draft needs the verify's context")
        return self._graph.submit_verify_then_draft(
            inputs, top_k, lambda output: dataclasses.replace(output, context=None)
        )

    def encode_context(self, inputs: EncodeInput) -> ContextHandle:
        self._graph.submit_target("encode_context", inputs, lambda output: output).result()
        return GraphContext(0)

    def release(self, slot: int) -> None:
        self._graph.release_target(slot)

    def close(self) -> None:
        """Tear down the step graph (after its queued releases); see `StepGraph.close`."""
        self._graph.close()

    def discard(self) -> None:
        """Tear down the step graph, dropping what is queued; see `StepGraph.discard`."""
        self._graph.discard()


class GraphDrafter:
    """`Drafter` (and `PipelinedDrafter`) over the step graph; its features came through it."""

    def __init__(self, graph: StepGraph, drafter: RayDrafter) -> None:
        self._graph = graph
        self._drafter = drafter

    @property
    def block_size(self) -> int:
        return self._drafter.block_size

    @property
    def actor(self) -> Any:
        return self._drafter.actor

    def is_available(self) -> bool:
        """After a loss: True once Ray restarted the drafter and the graph is compiled again.

        A drafter that answered and then died before the graph was built over it (its step
        socket refuses the target, a channel breaks) is still lost: asked again next step."""
        if self._graph.compiled:
            return True
        if not self._drafter.is_available():
            return False
        try:
            self._graph.recompile()
        except (*_LOST, OSError) as error:
            # Nothing is dropped: the releases queued meanwhile go with the next target call.
            logger.warning("step graph (%s) not rebuilt yet: %r", self._graph.transport, error)
            return False
        return True

    def draft(self, inputs: DraftInput) -> DraftOutput:
        return self.submit_draft(inputs).result()

    def submit_draft(self, inputs: DraftInput) -> Pending[DraftOutput]:
        return self._graph.submit_draft(inputs)

    def release(self, slot: int) -> None:
        self._graph.release_drafter(slot)


def _one_drafter_call(execution: _Execution) -> DrafterCall | None:
    """The serial graph's one drafter call: the chained draft (with the releases the execution's
    draft call holds) or the standalone one; serial executions never carry both with inputs."""
    if execution.chained is None:
        return execution.draft
    assert execution.draft is None or execution.draft.inputs is None, "one drafter call per execution"
    releases = () if execution.draft is None else execution.draft.releases
    return dataclasses.replace(execution.chained, releases=releases)


def _teardown(graph: Any) -> None:
    try:
        graph.teardown()
    except Exception:  # a graph over a dead actor may fail its own teardown: it is gone anyway
        logger.exception("teardown of the step graph failed")


def graph_workers(
    target: RayTarget | LocalTarget,
    drafter: RayDrafter,
    overlap: bool,
    transport: GraphTransport = "compiled_graph",
) -> tuple[GraphTarget, GraphDrafter]:
    """The seam over one step graph of the group's two workers (`overlap`: its shape)."""
    graph = StepGraph(target, drafter, overlap, transport)
    return GraphTarget(graph, target), GraphDrafter(graph, drafter)
