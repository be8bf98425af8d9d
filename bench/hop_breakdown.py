"""Where the served path's per-step milliseconds go, hop by hop, on a local Ray cluster.

Records the seam's real step payloads (`DraftInput` / `DraftOutput` / `VerifyInput` /
`VerifyOutput` and the context features) from the in-process engine on the bundled pair, then
replays them through each hop alone, with echo actors that do no model work:

- `wire+pickle`: the coordinator's `to_wire` + pickle of the inputs and the reverse for the
  outputs (what Ray's serializer does around every call), no Ray at all;
- `submit`: the `.remote()` call returning its ObjectRef;
- `actor call`: one blocking round trip (`ray.get(actor.echo.remote(payload))`), per seam call;
- `ref forward`: the drafter call taking the target's context ObjectRef as an argument;
- `compiled graph`: the same two calls as one Ray Compiled Graph over shared-memory channels
  (draft, verify, and the features target -> drafter inside the graph);
- `serve chunk`: one streamed chunk through a Serve deployment handle, through an ingress
  deployment forwarding a handle stream, and through the HTTP proxy (SSE).

The last table times whole engine steps on the real models: in process, over actor calls and
over both step graph transports (Ray's compiled graph and the workers' sockets), rounds
interleaved so the machine's load hits every configuration alike (`--configurations` picks
some). For the serial transports it also splits each seam call into its parts from the workers'
call traces (`serve/call_trace.py`) set beside the Coordinator's stamps (one clock for the
host's processes): the hop to the worker, the worker's unwiring, its model work, its wiring
(which waits for the device), and the hop back (for the chained step graphs' verify, the
drafter's chained draft is part of the hop back).

    python bench/hop_breakdown.py --batch-sizes 1 4 16 --repeats 200
    python bench/hop_breakdown.py --device cuda --dtype bfloat16 --num-cpus 8   # on the GPU machine
"""

import argparse
import cProfile
import io
import pickle
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.builder import target_dir
from ddtree_serve.engine.interfaces import (
    DraftChainingTarget,
    DraftInput,
    DraftOutput,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.ports import free_port
from ddtree_serve.serve.wire import from_wire, pack_features, to_wire

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Once upon a time"]


@dataclass(frozen=True)
class StepPayload:
    """One recorded step at one batch size: the seam's inputs and outputs, context as tensors."""

    draft_input: DraftInput  # contexts replaced by (position, index) pointers, as on the wire
    draft_output: DraftOutput
    verify_input: VerifyInput
    verify_output: VerifyOutput  # context=None
    context: list[torch.Tensor]  # the verify call's features, one [1 + accept_len, F] per request


class _Recorder:
    """Wraps the engine's target/drafter and keeps the last call's arguments and results."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, tuple[Any, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name not in ("draft", "verify_and_commit"):
            return attribute

        def recorded(inputs: Any) -> Any:
            output = attribute(inputs)
            self.calls[name] = (inputs, output)
            return output

        return recorded


def record_payload(batch_size: int, budget: int) -> StepPayload:
    """Steps the in-process engine on `batch_size` greedy requests and keeps a steady-state step."""
    engine = build_local_engine(EngineConfig(budget=budget, max_num_seqs=batch_size, max_seq_len=512))
    target, drafter = _Recorder(engine.target), _Recorder(engine.drafter)
    engine.target, engine.drafter = target, drafter  # type: ignore[assignment]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], params)
    for _ in range(4):  # past the prefill: the drafter takes one verify call's context per request
        engine.step()
    draft_input, draft_output = drafter.calls["draft"]
    verify_input, verify_output = target.calls["verify_and_commit"]
    pointers = [[replace(c, handle=0) for c in slices] for slices in draft_input.contexts]
    return StepPayload(
        replace(draft_input, contexts=pointers),
        draft_output,
        verify_input,
        replace(verify_output, context=None),
        list(verify_output.context),
    )


@ray.remote
class EchoWorker:
    """Returns a fixed result for any input: the transport's cost with no model work."""

    def __init__(self, result: Any, context: Any = None) -> None:
        self._result = result
        self._context = context

    @ray.method(num_returns=2)
    def verify(self, inputs: Any) -> tuple[Any, Any]:
        return self._result, self._context

    def draft(self, inputs: Any, *handles: Any) -> Any:
        return self._result


@ray.remote
class GraphEchoDrafter:
    """The drafter's half of the compiled step graph: draft, then take the target's features."""

    def __init__(self, result: Any) -> None:
        self._result = result
        self._context: list[Any] = []

    def draft(self, inputs: Any) -> Any:
        return None if inputs is None else self._result

    def take_context(self, context: Any) -> int:
        # Values read from a channel are zero-copy views of its buffer: keep a copy, or the
        # writer blocks on the next execution.
        self._context = [] if context is None else from_wire(context, copy=True).unpack()
        return len(self._context)


@ray.remote
class GraphEchoTarget:
    def __init__(self, result: Any, context: Any) -> None:
        self._result = result
        self._context = context

    @ray.method(num_returns=2)
    def verify(self, inputs: Any) -> tuple[Any, Any]:
        return (None, None) if inputs is None else (self._result, self._context)


class _CallStamper:
    """Wraps the engine's target/drafter adapter: (start, end) seconds of each draft/verify call.

    The seam methods are defined here, not forwarded by `__getattr__`: Python 3.12 checks runtime
    protocols (`PipelinedTarget`, `DraftChainingTarget`) on the class, not through `__getattr__`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, list[tuple[float, float]]] = {"draft": [], "verify_and_commit": []}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def draft(self, inputs: Any) -> Any:
        return self._stamped("draft", inputs)

    def verify_and_commit(self, inputs: Any) -> Any:
        return self._stamped("verify_and_commit", inputs)

    def _stamped(self, name: str, inputs: Any) -> Any:
        start = time.perf_counter()
        output = getattr(self.inner, name)(inputs)
        self.calls[name].append((start, time.perf_counter()))
        return output


class _ChainingStamper(_CallStamper):
    """A `_CallStamper` over a `DraftChainingTarget`: a chained verify is stamped from its
    submission to its verdict."""

    def submit_verify_then_draft(self, inputs: Any, top_k: int) -> Any:
        start = time.perf_counter()
        verdict, draft = self.inner.submit_verify_then_draft(inputs, top_k)
        return _StampedPending(verdict, start, self.calls["verify_and_commit"]), draft


def _stamper(inner: Any) -> _CallStamper:
    return _ChainingStamper(inner) if isinstance(inner, DraftChainingTarget) else _CallStamper(inner)


class _StampedPending:
    """A submitted call whose `result()` appends (submission, result) seconds to `calls`."""

    def __init__(self, pending: Any, start: float, calls: list[tuple[float, float]]) -> None:
        self._pending, self._start, self._calls = pending, start, calls

    def result(self) -> Any:
        value = self._pending.result()
        self._calls.append((self._start, time.perf_counter()))
        return value


# The worker-side methods of each seam call (actor calls, compiled graph).
_DRAFT_METHODS = ("draft", "graph_draft")
_VERIFY_METHODS = ("verify_and_commit", "graph_call:verify_and_commit")


def call_parts_ms(
    coordinator: list[tuple[float, float]], worker: list[Any], after: list[Any] | None = None
) -> dict[str, float]:
    """Median ms of each part of one seam call, pairing the Coordinator's calls with the worker's
    in order: hop in, the worker's marked parts, hop back (`after`: a second worker's calls that
    the Coordinator also waits for, e.g. the drafter taking the features; its time counts in the
    hop back)."""
    parts: dict[str, list[float]] = {}
    for index, ((start, end), stamps) in enumerate(zip(coordinator, worker, strict=False)):
        parts.setdefault("hop in", []).append(stamps.start_s - start)
        previous = stamps.start_s
        for part, at in stamps.marks:
            if part != "return":
                parts.setdefault(part, []).append(at - previous)
                previous = at
        returned = stamps.marks[-1][1]
        if after is not None and index < len(after):
            chained_s = after[index].marks[-1][1] - after[index].start_s
            parts.setdefault("chained draft (in hop back)", []).append(chained_s)
        parts.setdefault("hop back", []).append(end - returned)
        parts.setdefault("call", []).append(end - start)
    return {part: 1e3 * statistics.median(values) for part, values in parts.items()}


def median_ms(run: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall ms of `repeats` calls of `run` after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


def hop_table(payload: StepPayload, repeats: int) -> dict[str, float]:
    """Median ms of each hop for one recorded step (draft + verify unless named otherwise)."""
    wired_draft_in, wired_verify_in = to_wire(payload.draft_input), to_wire(payload.verify_input)
    wired_draft_out, wired_verify_out = to_wire(payload.draft_output), to_wire(payload.verify_output)
    wired_context = to_wire(pack_features(payload.context))  # as the target worker sends it

    def serialize() -> None:
        for value in (payload.draft_input, payload.verify_input):
            pickle.loads(pickle.dumps(to_wire(value), protocol=5))
        for value in (wired_draft_out, wired_verify_out):
            from_wire(pickle.loads(pickle.dumps(value, protocol=5)))

    drafter = EchoWorker.remote(wired_draft_out)
    target = EchoWorker.remote(wired_verify_out, wired_context)
    ray.get([drafter.draft.remote(None), target.verify.remote(None)[0]])

    def actor_calls() -> None:
        output_ref, context_ref = target.verify.remote(wired_verify_in)
        ray.get(output_ref)
        ray.get(drafter.draft.remote(wired_draft_in, context_ref))

    def actor_calls_no_ref() -> None:
        ray.get(target.verify.remote(wired_verify_in)[0])
        ray.get(drafter.draft.remote(wired_draft_in))

    submitted: list[Any] = []

    def submit() -> None:
        submitted.append(target.verify.remote(wired_verify_in))

    figures = {
        "wire+pickle (4 values)": median_ms(serialize, repeats),
        "submit (.remote only)": median_ms(submit, repeats),
        "actor calls, no ref": median_ms(actor_calls_no_ref, repeats),
        "actor calls + ref forward": median_ms(actor_calls, repeats),
    }
    ray.get([refs[0] for refs in submitted])

    graph_drafter = GraphEchoDrafter.remote(wired_draft_out)
    graph_target = GraphEchoTarget.remote(wired_verify_out, wired_context)
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as step:
        draft = graph_drafter.draft.bind(step[0])
        verify, context = graph_target.verify.bind(step[1])
        taken = graph_drafter.take_context.bind(context)
        dag = MultiOutputNode([draft, verify, taken])
    graph = dag.experimental_compile()
    try:
        figures["compiled graph, 2 executions"] = median_ms(
            lambda: (
                ray.get(graph.execute(wired_draft_in, None)),
                ray.get(graph.execute(None, wired_verify_in)),
            ),
            repeats,
        )
        figures["compiled graph, 1 execution (overlap)"] = median_ms(
            lambda: ray.get(graph.execute(wired_draft_in, wired_verify_in)), repeats
        )
    finally:
        graph.teardown()
    for actor in (drafter, target, graph_drafter, graph_target):
        ray.kill(actor)
    return figures


def serve_chunk_table(num_chunks: int) -> dict[str, float]:
    """ms per streamed chunk: a deployment handle, an ingress forwarding it, the HTTP proxy."""
    import httpx
    from ray import serve
    from starlette.responses import StreamingResponse

    @serve.deployment(ray_actor_options={"num_cpus": 0.25})
    class Streamer:
        async def chunks(self, n: int):  # type: ignore[no-untyped-def]
            for i in range(n):
                yield i

    @serve.deployment(ray_actor_options={"num_cpus": 0.25})
    class Forwarder:
        def __init__(self, streamer: Any) -> None:
            self._streamer = streamer.options(stream=True)

        async def chunks(self, n: int):  # type: ignore[no-untyped-def]
            async for item in self._streamer.chunks.remote(n):
                yield item

        async def __call__(self, request: Any) -> StreamingResponse:
            n = int(request.query_params["n"])

            async def sse():  # type: ignore[no-untyped-def]
                async for item in self._streamer.chunks.remote(n):
                    yield f"data: {item}\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

    port = free_port()
    serve.start(http_options={"port": port})
    forwarder = serve.run(Forwarder.bind(Streamer.bind()), name="hops", route_prefix="/")
    streamer = serve.get_deployment_handle("Streamer", app_name="hops").options(stream=True)
    forwarding = forwarder.options(stream=True)

    def drain(handle: Any) -> None:
        for _ in handle.chunks.remote(num_chunks):
            pass

    def http() -> None:
        with httpx.stream("GET", f"http://127.0.0.1:{port}/?n={num_chunks}", timeout=60) as response:
            for _ in response.iter_lines():
                pass

    figures = {
        "serve chunk: handle": median_ms(lambda: drain(streamer), 5) / num_chunks,
        "serve chunk: ingress -> handle": median_ms(lambda: drain(forwarding), 5) / num_chunks,
        "serve chunk: HTTP proxy -> ingress -> handle": median_ms(http, 5) / num_chunks,
    }
    serve.shutdown()
    return figures


def engine_step_table(
    batch_size: int,
    budget: int,
    steps: int,
    rounds: int,
    device: str,
    dtype: str,
    only: list[str] | None = None,
    profile_top: int = 0,
) -> dict[str, float]:
    """ms per engine step on the real models, per transport and overlap, rounds interleaved.

    `profile_top` > 0: also print, per configuration, the functions the Coordinator's process
    spent most of the timed steps in (cProfile, cumulative time; the figures carry its overhead).

    An idle compiled graph's actors poll their channels (a core each): only the graph of the
    configuration being timed exists, compiled again each round over that configuration's
    actors, so the others' figures are not skewed."""
    from ddtree_serve.serve.compiled_graph import GraphTarget, graph_workers
    from ddtree_serve.serve.config import ServeConfig
    from ddtree_serve.serve.group import start_workers

    engine_config = EngineConfig(
        budget=budget,
        max_num_seqs=batch_size,
        max_seq_len=512,
        device=device,
        dtype=dtype,
        record_timings=True,  # host wall time per stage: where a transport's milliseconds go
    )
    settings = engine_config.to_settings()
    tokenizer = load_tokenizer(target_dir(engine_config))
    # (name, placement, step graph transport or None, overlap, chained drafts)
    configurations = [
        ("in_process", "in_process", None, False, False),
        ("actor_calls", "actors", None, False, False),
        ("actor_calls+overlap", "actors", None, True, False),
        ("compiled_graph", "actors", "compiled_graph", False, False),
        ("compiled_graph+chained", "actors", "compiled_graph", False, True),
        ("compiled_graph+overlap", "actors", "compiled_graph", True, False),
        ("sockets", "actors", "sockets", False, False),
        ("sockets+chained", "actors", "sockets", False, True),
        ("sockets+overlap", "actors", "sockets", True, False),
        # The target in this process (the Coordinator's, served), the drafter in its actor: the
        # socket graph comes built from `start_workers`, in the configuration's shape.
        ("local_target", "target_in_coordinator", None, False, False),
        ("local_target+chained", "target_in_coordinator", None, False, True),
        ("local_target+overlap", "target_in_coordinator", None, True, False),
    ]
    if only:
        configurations = [c for c in configurations if c[0] in only]
    workers = {}
    # On one GPU every configuration's drafter and target share it.
    num_actors = sum({"actors": 2, "target_in_coordinator": 1}.get(c[1], 0) for c in configurations)
    gpu_share = int(1e4 / max(num_actors, 1)) / 1e4 if device.startswith("cuda") else 0.0
    small = {"num_cpus": 0.1, "num_gpus": gpu_share}
    for name, placement, _, overlap, _ in configurations:
        local = placement == "target_in_coordinator"
        # Two actors start bare (actor calls): a configuration's own graph is built each round.
        shape = {"overlap": overlap} if local else {"transport": "actor_calls"}
        config = ServeConfig(
            engine=engine_config,
            placement={"workers": placement, **shape, "drafter": small, "target": small},  # type: ignore[arg-type]
        )
        workers[name] = start_workers(config)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    samples: dict[str, list[float]] = {name: [] for name, *_ in configurations}
    stage_ms: dict[str, dict[str, float]] = {name: {} for name, *_ in configurations}
    parts_ms: dict[str, dict[str, float]] = {}
    profiles = {name: cProfile.Profile() for name, *_ in configurations} if profile_top else {}
    for round_index in range(rounds):
        for name, placement, graph, overlap, chained in configurations:
            target, drafter = workers[name]
            if graph is not None:
                target, drafter = graph_workers(target, drafter, overlap, graph)  # type: ignore[arg-type]
            traced = placement != "in_process" and not overlap
            if traced:
                ray.get([w.actor.trace_calls.remote(True) for w in _with_actors(target, drafter)])
                target, drafter = _stamper(target), _stamper(drafter)  # type: ignore[assignment]
            engine = SpecEngine(settings, target, drafter, tokenizer, overlap=overlap, chain_drafts=chained)
            for i in range(batch_size):
                engine.add_request(f"{round_index}-{i}", PROMPTS[i % len(PROMPTS)], params)
            engine.step()  # prefill + first step out of the figure
            engine.timer.reset()
            if traced:
                _take_traces(target, drafter)
            start = time.perf_counter()
            if profiles:
                profiles[name].enable()
            for _ in range(steps):
                engine.step()
            if profiles:
                profiles[name].disable()
            samples[name].append(1e3 * (time.perf_counter() - start) / steps)
            if traced:
                own_drafts = list(drafter.calls["draft"])  # type: ignore[union-attr]
                own_verifies = list(target.calls["verify_and_commit"])  # type: ignore[union-attr]
                target_calls, drafter_calls = _take_traces(target, drafter)
                chained_drafts = [c for c in drafter_calls if c.method == "graph_chained_draft"]
                draft_parts = call_parts_ms(
                    own_drafts, [c for c in drafter_calls if c.method in _DRAFT_METHODS]
                )
                verify_parts = call_parts_ms(
                    own_verifies,
                    [c for c in target_calls if c.method in _VERIFY_METHODS],
                    chained_drafts if chained else None,
                )
                for seam, seam_parts in (("draft", draft_parts), ("verify", verify_parts)):
                    for part, ms in seam_parts.items():
                        parts_ms[f"    {name} {seam}: {part}"] = ms
                target, drafter = target.inner, drafter.inner  # type: ignore[union-attr]
            for stage, seconds in engine.timer.seconds.items():
                total = stage_ms[name].get(stage, 0.0) + 1e3 * seconds / steps / rounds
                stage_ms[name][stage] = total
            for i in range(batch_size):
                engine.abort_request(f"{round_index}-{i}")
            engine.step()
            if graph is not None:
                target.close()  # type: ignore[union-attr]
    for target, drafter in workers.values():
        if isinstance(target, GraphTarget):  # a local target's graph, built by `start_workers`
            target.close()
        for worker in (target, drafter):
            if getattr(worker, "actor", None) is not None:
                ray.kill(worker.actor)
    for name, profile in profiles.items():
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        text.write(f"\n== profile, {name}, B={batch_size}: {steps * rounds} steps, cumulative time\n")
        stats.sort_stats("cumulative").print_stats(profile_top)
        print(text.getvalue(), flush=True)
    figures = {f"engine step: {name}": statistics.median(values) for name, values in samples.items()}
    for name, stages in stage_ms.items():
        for stage, ms in stages.items():
            figures[f"  {name}: {stage}"] = ms
    figures.update(parts_ms)  # the last round's
    return figures


def _take_traces(target: Any, drafter: Any) -> tuple[list[Any], list[Any]]:
    """Both workers' stamped calls since the last take; the stampers' own stamps restart too."""
    for stamper in (target, drafter):
        for calls in stamper.calls.values():
            calls.clear()
    if getattr(target.inner, "actor", None) is None:  # the target in this process: no trace
        return [], ray.get(drafter.actor.take_call_trace.remote())
    return tuple(ray.get([w.actor.take_call_trace.remote() for w in (target, drafter)]))  # type: ignore[return-value]


def _with_actors(*workers: Any) -> list[Any]:
    return [w for w in workers if getattr(w, "actor", None) is not None]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200, help="Timed round trips per hop.")
    parser.add_argument("--chunks", type=int, default=200, help="Chunks per timed stream.")
    parser.add_argument("--steps", type=int, default=20, help="Timed engine steps per round.")
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved rounds per transport.")
    parser.add_argument("--skip-engine", action="store_true", help="Only the echo hops.")
    parser.add_argument(
        "--configurations",
        nargs="+",
        help="Engine-step configurations to time (default: all; e.g. in_process sockets compiled_graph).",
    )
    parser.add_argument("--device", default="cpu", help="Model device of the engine steps (default: cpu).")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="(default: float32)"
    )
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster (default: 2).")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="Print each configuration's N costliest functions of the timed steps (default: 0, none).",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    payloads = {b: record_payload(b, args.budget) for b in args.batch_sizes}
    ray_dir = tempfile.mkdtemp(prefix="ddtree-hops-")
    num_gpus = 1 if args.device.startswith("cuda") else 0
    ray.init(
        address="local", num_cpus=args.num_cpus, num_gpus=num_gpus, include_dashboard=False, _temp_dir=ray_dir
    )
    try:
        tables = {b: hop_table(p, args.repeats) for b, p in payloads.items()}
        if not args.skip_engine:
            for b in args.batch_sizes:
                tables[b].update(
                    engine_step_table(
                        b,
                        args.budget,
                        args.steps,
                        args.rounds,
                        args.device,
                        args.dtype,
                        args.configurations,
                        args.profile,
                    )
                )
        chunks = serve_chunk_table(args.chunks)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)

    names = list(tables[args.batch_sizes[0]])
    print(f"\nbudget={args.budget}; median ms per step (draft + verify) unless named\n")
    print("| hop | " + " | ".join(f"B={b}" for b in args.batch_sizes) + " |")
    print("|---|" + "---|" * len(args.batch_sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{tables[b][name]:.2f}" for b in args.batch_sizes) + " |")
    print("\n| serve hop | ms per chunk |\n|---|---|")
    for name, value in chunks.items():
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    main()
