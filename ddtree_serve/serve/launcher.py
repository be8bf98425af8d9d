"""`ddtree-serve serve`: start Ray locally, deploy the application, serve until interrupted.

The CLI registers `add_serve_arguments` / `run_serve`; `python -m ddtree_serve.serve.launcher`
runs the same thing. Command-line flags override the config file, and the merged result goes
through `ServeConfig` validation like every other way in. On Ctrl-C (or SIGTERM) Serve and the
Ray cluster this command started are shut down, leaving no Ray process behind; on a cluster
joined with `--ray-address` only this application is deleted.
"""

import argparse
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, get_args

import yaml
from pydantic import ValidationError

from ddtree_serve.cli import cost_curve_problem, one_line_error
from ddtree_serve.engine.builder import fitted_max_seq_len, target_dir
from ddtree_serve.models.context_length import target_context_length
from ddtree_serve.serve.config import RAY_SYSTEM_CONFIG, PlacementTransport, PlacementWorkers, ServeConfig

DASHBOARD_PORT = 8265  # Ray's own default
AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"
THROUGHPUT_OPTIMIZED_VARIABLE = "RAY_SERVE_THROUGHPUT_OPTIMIZED"


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def _resource_count(text: str) -> float:
    count = float(text)
    if not count >= 0.0 or math.isinf(count):
        raise argparse.ArgumentTypeError(f"a count of logical resources is a finite number >= 0, got {text}")
    return count


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags override the config file, so none has an argparse default; the help shows the
    value that applies when neither the flag nor the file sets it."""
    defaults = ServeConfig()
    engine = defaults.engine

    def default(value: object) -> str:
        return f"(default: {value})"

    parser.add_argument(
        "--config",
        help="ServeConfig YAML or a Serve config file (deployments/*.yaml) (default: none, the built-in "
        "defaults below).",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", help=f"HTTP bind address {default(defaults.http.host)}.")
    server.add_argument("--http-port", type=int, help=f"HTTP port {default(defaults.http.port)}.")
    server.add_argument(
        "--grpc-port", type=int, help=f"gRPC port, all interfaces {default(defaults.grpc.port)}."
    )
    server.add_argument("--model-name", help=f"Name clients pass as `model` {default(defaults.model_name)}.")
    server.add_argument(
        "--stream-batching-interval-ms",
        type=float,
        help="A stream sends at most one chunk per interval after its first (Ray Serve LLM's "
        f"setting; 0 = one per step) {default(defaults.stream_batching_interval_ms)}.",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--target", help="Target model directory (default: the bundled target).")
    model.add_argument("--drafter", help="DFlash drafter directory (default: the bundled drafter).")
    model.add_argument(
        "--device", help=f"Model device inside the workers: cpu, cuda {default(engine.device)}."
    )
    model.add_argument(
        "--mode",
        choices=["ar", "chain", "ddtree"],
        help=f"ar: plain decoding; chain: linear DFlash draft; ddtree: draft trees {default(engine.mode)}.",
    )
    model.add_argument(
        "--budget", type=int, help=f"DDTree nodes per request per step {default(engine.budget)}."
    )
    model.add_argument(
        "--budget-policy",
        choices=["fixed", "adaptive"],
        help="fixed: every tree gets --budget nodes; adaptive (mode ddtree): per step, nodes where "
        "they are likely accepted while predicted tokens/s rise, or no draft when drafting does "
        f"not pay; --budget stays the ceiling {default(engine.budget_policy)}.",
    )
    model.add_argument(
        "--cost-curve",
        metavar="FILE",
        help="adaptive: step-cost JSON over (batch, tree tokens), e.g. from bench/kimi_slice.py "
        "(default: measured when each group starts).",
    )
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="Run every forward eagerly, no CUDA graphs (default: graphs on CUDA).",
    )
    placement = parser.add_argument_group("placement (one speculation group)")
    defaults_placement = defaults.placement
    placement.add_argument(
        "--workers",
        choices=get_args(PlacementWorkers),
        help="actors: drafter and target actors (a lost target restarts in place); "
        "target_in_coordinator: the target inside the Coordinator replica; engine_core: the target "
        "and the engine loop in an actor of their own, the drafter in its actor; "
        "engine_core_colocated: that core with the drafter in it too (no step hop: for both "
        "models on one GPU, README Benchmarks); in_process: both models in the replica "
        f"{default(defaults_placement.workers)}.",
    )
    placement.add_argument(
        "--transport",
        choices=get_args(PlacementTransport),
        help="How the Coordinator reaches the worker actors each step (auto: the workers' own "
        f"sockets where they fit) {default(defaults_placement.transport)}.",
    )
    placement.add_argument(
        "--overlap",
        action="store_true",
        default=None,
        help="Two micro-batches in flight: the drafter drafts one while the target verifies the "
        f"other (fixed budget, a drafter) {default(defaults_placement.overlap)}.",
    )
    placement.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help=f"Target ranks, one GPU each {default(defaults_placement.tensor_parallel_size)}.",
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-num-seqs",
        type=int,
        help=f"Running requests per speculation group {default(engine.max_num_seqs)}.",
    )
    limits.add_argument(
        "--max-queue-len",
        type=int,
        help="Waiting requests per group; beyond it HTTP 503 / RESOURCE_EXHAUSTED "
        f"{default(engine.max_queue_len)}.",
    )
    limits.add_argument(
        "--max-seq-len",
        "--max-model-len",
        dest="max_seq_len",
        type=int,
        help="Positions per request: prompt + completion + one draft tree; at most the target's "
        f"context length {default(engine.max_seq_len)}, capped there when not given.",
    )
    limits.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help=f"Tokens one step may feed the target {default(engine.max_num_batched_tokens)}.",
    )
    tracing = parser.add_argument_group("observability")
    tracing.add_argument(
        "--tracing",
        choices=["none", "file", "otlp"],
        help=f"Span exporter {default(defaults.observability.tracing.exporter)}.",
    )
    tracing.add_argument(
        "--tracing-file",
        help=f"Span file for --tracing file {default(defaults.observability.tracing.file_path)}.",
    )
    tracing.add_argument(
        "--otlp-endpoint",
        help=f"OTLP/HTTP traces endpoint {default(defaults.observability.tracing.otlp_endpoint)}.",
    )
    ray_group = parser.add_argument_group("ray (local cluster)")
    ray_group.add_argument(
        "--ray-address",
        help="Join this Ray cluster instead of starting a local one (default: none, a local cluster).",
    )
    ray_group.add_argument("--num-cpus", type=_resource_count, help="Logical CPUs (default: all cores).")
    ray_group.add_argument("--num-gpus", type=_resource_count, help="Logical GPUs (default: the GPUs found).")
    ray_group.add_argument("--ray-temp-dir", help="Temp/session directory (default: Ray's, /tmp/ray).")
    ray_group.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="Do not start the Ray dashboard (default: on, at 127.0.0.1; `ray list actors` needs it).",
    )
    ray_group.add_argument(
        "--dashboard-port",
        type=_port,
        default=DASHBOARD_PORT,
        help="Ray dashboard port (default: %(default)s).",
    )
    ray_group.add_argument(
        "--serve-throughput-optimized",
        action="store_true",
        help=f"Start the local cluster in Ray Serve's throughput-optimized mode "
        f"({THROUGHPUT_OPTIMIZED_VARIABLE}=1: direct ingress to the replicas, gRPC between "
        "deployments, replica code on its own event loop). A cluster started elsewhere takes "
        "the variable from its own environment (default: off).",
    )
    ray_group.add_argument(
        "--metrics-export-port",
        type=_port,
        help="Port of Ray's Prometheus metrics endpoint (default: one Ray picks; printed at start-up).",
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The config file (or defaults) with every flag that was given applied on top."""
    base = ServeConfig.from_yaml(args.config) if args.config else ServeConfig()
    # Only what the file set: a field left at its default stays unset, so the engine can tell
    # a default max_seq_len (capped at the target's context length) from an asked-for one.
    raw: dict[str, Any] = base.model_dump(exclude_unset=True)
    overrides = {
        ("model_name",): args.model_name,
        ("stream_batching_interval_ms",): args.stream_batching_interval_ms,
        ("http", "host"): args.host,
        ("http", "port"): args.http_port,
        ("grpc", "port"): args.grpc_port,
        ("engine", "target"): args.target,
        ("engine", "drafter"): args.drafter,
        ("engine", "mode"): args.mode,
        ("engine", "budget"): args.budget,
        ("engine", "budget_policy"): args.budget_policy,
        # Workers read the file; a path relative to this shell means nothing to them.
        ("engine", "cost_curve"): None if args.cost_curve is None else os.path.abspath(args.cost_curve),
        ("engine", "device"): args.device,
        ("engine", "enforce_eager"): args.enforce_eager,
        ("engine", "max_num_seqs"): args.max_num_seqs,
        ("engine", "max_queue_len"): args.max_queue_len,
        ("engine", "max_seq_len"): args.max_seq_len,
        ("engine", "max_num_batched_tokens"): args.max_num_batched_tokens,
        ("placement", "workers"): args.workers,
        ("placement", "transport"): args.transport,
        ("placement", "overlap"): args.overlap,
        ("placement", "tensor_parallel_size"): args.tensor_parallel_size,
        ("observability", "tracing", "exporter"): args.tracing,
        ("observability", "tracing", "file_path"): args.tracing_file,
        ("observability", "tracing", "otlp_endpoint"): args.otlp_endpoint,
    }
    for path, value in overrides.items():
        if value is None:
            continue
        section = raw
        for key in path[:-1]:
            section = section.setdefault(key, {})
        section[path[-1]] = value
    return ServeConfig.model_validate(raw)


def local_file_problem(config: ServeConfig) -> str | None:
    """What a local cluster would fail on when its groups load files from this disk, if any:
    a model directory without config.json, a `max_seq_len` past the target's context length or
    a config it cannot read there, or a cost curve that does not load."""
    if problem := config.engine.missing_model_dir():
        return problem
    target = target_dir(config.engine)
    try:  # not JSON, not a mapping, an unknown family, a missing field, an unreadable file:
        target_context_length(target)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as error:
        return f"target {target / 'config.json'}: {type(error).__name__}: {one_line_error(error)}"
    try:
        fitted_max_seq_len(config.engine)
    except ValueError as error:
        return str(error)
    if config.engine.cost_curve is not None and (problem := cost_curve_problem(config.engine.cost_curve)):
        return f"cost curve {config.engine.cost_curve}: {problem}"
    return None


def ports_taken(config: ServeConfig, args: argparse.Namespace) -> str | None:
    """The ports a local cluster would bind that are in use or shared, named with their flags
    (None: all free). Ray's own failure to bind one is a traceback of 20-300 lines, after seconds
    of start-up."""
    wanted = [("--http-port", config.http.host, config.http.port), ("--grpc-port", "", config.grpc.port)]
    if args.dashboard:
        wanted.append(("--dashboard-port", "127.0.0.1", args.dashboard_port))
    if args.metrics_export_port is not None:
        wanted.append(("--metrics-export-port", "", args.metrics_export_port))
    seen: dict[int, str] = {}
    for flag, host, port in wanted:
        if port in seen:
            return f"{flag} {port} is also {seen[port]}: each server needs its own port"
        seen[port] = flag
        if not port_is_free(host, port):
            return f"{flag} {port}: in use on {host or 'this host'} (pick another port or stop what holds it)"
    return None


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on `host`:`port` now (as servers do, with SO_REUSEADDR, so
    a port a closed server left in TIME_WAIT counts as free)."""
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror:
        return True  # an address this host cannot resolve: Serve's own error names it
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen(1)
        except OSError:
            return False
    return True


def deploy_failure(error: BaseException, app_name: str) -> str:
    """A failed `serve.run` in one line: Serve's own first line (the deployments that failed) and,
    from `serve.status()`, the last line of each failed deployment's message (the replica's
    exception, the root cause)."""
    from ray import serve

    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    summary = lines[0] if lines else type(error).__name__
    try:
        application = serve.status().applications.get(app_name)
        deployments = application.deployments.items() if application is not None else ()
    except Exception:  # the controller is gone too: Serve's line is all there is
        return summary
    causes = [
        f"{name}: {message[-1]}"
        for name, deployment in deployments
        if str(deployment.status).endswith(("DEPLOY_FAILED", "UNHEALTHY"))
        and (message := [line.strip() for line in str(deployment.message).splitlines() if line.strip()])
    ]
    return "; ".join([summary, *causes])


def ray_init_options(args: argparse.Namespace) -> dict[str, Any]:
    """`ray.init` keyword arguments: join `--ray-address`, or a local cluster on 127.0.0.1."""
    if args.ray_address is not None:
        return {"address": args.ray_address}
    options = {
        "num_cpus": args.num_cpus,
        "num_gpus": args.num_gpus,
        "_temp_dir": args.ray_temp_dir,
        "include_dashboard": args.dashboard,
        "dashboard_host": "127.0.0.1",
        "dashboard_port": args.dashboard_port,
        "_metrics_export_port": args.metrics_export_port,
        "_system_config": RAY_SYSTEM_CONFIG,
    }
    return {key: value for key, value in options.items() if value is not None}


def choose_local_auth_mode() -> str:
    """The token-authentication line to print; sets `RAY_AUTH_MODE` for a local cluster.

    Ray 2.5x turns token authentication on for a new local cluster and warns that it did when
    the mode is unset. Keeping it on is right (anyone who can reach a port could run code), so
    the mode is set explicitly, which is what silences the warning; the user's choice wins.
    """
    chosen = os.environ.get(AUTH_MODE_VARIABLE)
    if chosen is not None:
        return f"Ray token authentication: {AUTH_MODE_VARIABLE}={chosen} (from the environment)"
    os.environ[AUTH_MODE_VARIABLE] = "token"
    return (
        f"Ray token authentication: on ({AUTH_MODE_VARIABLE}=token; the dashboard asks for the token "
        f"that `ray get-auth-token` prints; export {AUTH_MODE_VARIABLE}=disabled to turn it off)"
    )


def choose_serve_mode(throughput_optimized: bool) -> str | None:
    """The Serve-mode line to print; sets `RAY_SERVE_THROUGHPUT_OPTIMIZED` for a local cluster
    when asked. Ray Serve reads it in every process it starts, which inherit this process's
    environment through `ray.init`; a value already in the environment wins."""
    chosen = os.environ.get(THROUGHPUT_OPTIMIZED_VARIABLE)
    if chosen is not None:
        return f"Ray Serve: {THROUGHPUT_OPTIMIZED_VARIABLE}={chosen} (from the environment)"
    if not throughput_optimized:
        return None
    os.environ[THROUGHPUT_OPTIMIZED_VARIABLE] = "1"
    return f"Ray Serve: throughput-optimized mode ({THROUGHPUT_OPTIMIZED_VARIABLE}=1)"


class _DropServeStartNotice(logging.Filter):
    """`serve.run` starts Serve with default options unless it already runs, and logs that the
    "new" http_options are not applied; here they were applied by our `serve.start` just before,
    so that notice says the opposite of what happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will not be applied" not in record.getMessage()


@contextmanager
def _without_serve_start_notice() -> Iterator[None]:
    serve_logger = logging.getLogger("ray.serve")
    notice_filter = _DropServeStartNotice()
    serve_logger.addFilter(notice_filter)
    try:
        yield
    finally:
        serve_logger.removeFilter(notice_filter)


def direct_ingress_ports(app_name: str) -> dict[str, int]:
    """The ingress replica's own ports ("http", "grpc") under Ray Serve's direct ingress (the
    throughput-optimized mode; empty when it is off): where a client or a load balancer may
    connect instead of the proxies, one hop shorter. Read from the controller's target groups,
    whose proxy groups name no ingress deployment."""
    import ray
    from ray.serve.context import _get_global_client

    groups = ray.get(_get_global_client()._controller.get_target_groups.remote(app_name))
    return {
        str(group.protocol.value).lower(): group.targets[0].port
        for group in groups
        if group.app_name == app_name and group.ingress_deployment_name and group.targets
    }


def metrics_endpoint() -> str | None:
    """This node's Prometheus endpoint (Ray's metrics export port), once Ray is up."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


def run_serve(args: argparse.Namespace) -> int:
    """Deploys and blocks until SIGINT/SIGTERM; returns the process exit code."""
    try:
        config = config_from_args(args)
    except (OSError, yaml.YAMLError, ValidationError, ValueError) as error:
        print(f"ddtree-serve serve: error: {one_line_error(error)}", file=sys.stderr)
        return 2
    if args.ray_address is None and (problem := local_file_problem(config) or ports_taken(config, args)):
        # A local cluster reads the same disk and binds on this host: refuse now instead of
        # failing replicas in a loop or Ray's start-up with a page of traceback.
        print(f"ddtree-serve serve: error: {problem}", file=sys.stderr)
        return 2
    stop, deployed = threading.Event(), threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        print(f"\nreceived {signal.Signals(signum).name}; shutting down", flush=True)
        stop.set()
        if not deployed.is_set():
            # `serve.run` waits until every replica runs: a model loading for minutes, or a
            # placement the cluster cannot schedule (waiting for ever), would hold Ctrl-C there.
            raise KeyboardInterrupt

    # Before Ray is imported: its core reads RAY_AUTH_MODE once, at import.
    auth_line = choose_local_auth_mode() if args.ray_address is None else None
    serve_mode_line = choose_serve_mode(args.serve_throughput_optimized) if args.ray_address is None else None
    import ray
    from ray import serve

    from ddtree_serve.serve.app import build_app, serve_start_options

    try:
        context = ray.init(**ray_init_options(args))
    except KeyboardInterrupt:  # while joining a cluster that does not answer, say
        return 130
    except Exception as error:  # a bad address, a temp dir that is a file, resources Ray refuses
        where = f"join the cluster at {args.ray_address}" if args.ray_address else "start a local Ray cluster"
        print(f"ddtree-serve serve: error: could not {where}: {one_line_error(error)}", file=sys.stderr)
        ray.shutdown()  # whatever part of it did start
        return 1
    # After ray.init: Ray installs its own SIGTERM handler there, which would skip our shutdown.
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            serve.start(**serve_start_options(config))
            with _without_serve_start_notice():
                serve.run(build_app(config), name=config.app_name, route_prefix="/", blocking=False)
        except KeyboardInterrupt:
            return 130  # stopped while deploying (the shell's code for Ctrl-C); `finally` cleans up
        except RuntimeError as error:
            # Serve has logged each failed replica's traceback above; its own error repeats them
            # inside a page of its frames. One line says what failed, and why, in the end.
            print(f"ddtree-serve serve: error: {deploy_failure(error, config.app_name)}", file=sys.stderr)
            return 1
        deployed.set()
        engine = config.engine
        print(
            f"ddtree-serve: model {config.model_name!r} "
            f"({engine.mode}, budget {engine.budget}, {engine.budget_policy} budget policy)"
        )
        print(f"  HTTP       http://{config.http.host}:{config.http.port}/v1  (OpenAI-compatible)")
        # Ray Serve's gRPC proxy takes no host: it listens on every interface ([::]).
        print(f"  gRPC       127.0.0.1:{config.grpc.port}  (ddtree_serve.v1.DDTreeServe; all interfaces)")
        if direct := direct_ingress_ports(config.app_name):
            print(
                f"  direct     http://{config.http.host}:{direct['http']}/v1, gRPC 127.0.0.1:{direct['grpc']}"
                "  (the ingress replica's own servers: no proxy hop)"
            )
        dashboard_url = getattr(context, "dashboard_url", None)
        print(f"  dashboard  {'http://' + dashboard_url if dashboard_url else 'off (--no-dashboard)'}")
        print(f"  metrics    {metrics_endpoint() or 'unknown'}  (Prometheus, ray_ddtree_*)")
        for line in (auth_line, serve_mode_line):
            if line:
                print(f"  {line}")
        print("Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        if args.ray_address is None:
            serve.shutdown()  # our own cluster: take everything down
        else:
            serve.delete(config.app_name)  # a shared cluster: other Serve apps keep running
        ray.shutdown()  # on a joined cluster this only disconnects
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree-serve serve", description=__doc__)
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
