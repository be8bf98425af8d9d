"""`ddtree-serve serve`: start Ray locally, deploy the application, serve until interrupted.

The CLI registers `add_serve_arguments` / `run_serve`; `python -m ddtree_serve.serve.launcher`
runs the same thing. Command-line flags override the config file, and the merged result goes
through `ServeConfig` validation like every other way in. On Ctrl-C (or SIGTERM) Serve and the
Ray cluster this command started are shut down, leaving no Ray process behind; on a cluster
joined with `--ray-address` only this application is deleted.
"""

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

import yaml
from pydantic import ValidationError

from ddtree_serve.serve.config import ServeConfig


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="ServeConfig YAML or a Serve config file (deployments/*.yaml).")
    parser.add_argument("--host", help="HTTP bind address (default 127.0.0.1).")
    parser.add_argument("--http-port", type=int, help="HTTP port (default 8000).")
    parser.add_argument("--grpc-port", type=int, help="gRPC port (default 9000).")
    parser.add_argument("--target", help="Target model directory (default: the bundled target).")
    parser.add_argument("--drafter", help="DFlash drafter directory (default: the bundled drafter).")
    parser.add_argument("--mode", choices=["ar", "chain", "ddtree"], help="Decoding mode.")
    parser.add_argument("--budget", type=int, help="DDTree node budget per step.")
    parser.add_argument("--device", help="Model device inside the workers: cpu, cuda.")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="Run every forward eagerly (no CUDA graphs).",
    )
    parser.add_argument("--max-num-seqs", type=int, help="Running requests per speculation group.")
    parser.add_argument("--model-name", help="Name clients pass as `model`.")
    parser.add_argument("--tracing", choices=["none", "file", "otlp"], help="Span exporter.")
    parser.add_argument("--tracing-file", help="Span file for --tracing file.")
    parser.add_argument("--otlp-endpoint", help="OTLP/HTTP traces endpoint for --tracing otlp.")
    parser.add_argument("--ray-address", help="Join this Ray cluster instead of starting a local one.")
    parser.add_argument("--num-cpus", type=float, help="Logical CPUs of the local Ray cluster.")
    parser.add_argument("--num-gpus", type=float, help="Logical GPUs of the local Ray cluster.")
    parser.add_argument("--ray-temp-dir", help="Temp/session directory of the local Ray cluster.")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The config file (or defaults) with every flag that was given applied on top."""
    base = ServeConfig.from_yaml(args.config) if args.config else ServeConfig()
    raw: dict[str, Any] = base.model_dump(exclude_unset=False)
    overrides = {
        ("http", "host"): args.host,
        ("http", "port"): args.http_port,
        ("grpc", "port"): args.grpc_port,
        ("engine", "target"): args.target,
        ("engine", "drafter"): args.drafter,
        ("engine", "mode"): args.mode,
        ("engine", "budget"): args.budget,
        ("engine", "device"): args.device,
        ("engine", "enforce_eager"): args.enforce_eager,
        ("engine", "max_num_seqs"): args.max_num_seqs,
        ("observability", "tracing", "exporter"): args.tracing,
        ("observability", "tracing", "file_path"): args.tracing_file,
        ("observability", "tracing", "otlp_endpoint"): args.otlp_endpoint,
    }
    for path, value in overrides.items():
        if value is None:
            continue
        section = raw
        for key in path[:-1]:
            section = section[key]
        section[path[-1]] = value
    if args.model_name is not None:
        raw["model_name"] = args.model_name
    return ServeConfig.model_validate(raw)


def run_serve(args: argparse.Namespace) -> int:
    """Deploys and blocks until SIGINT/SIGTERM; returns the process exit code."""
    import ray
    from ray import serve

    from ddtree_serve.serve.app import build_app, serve_start_options

    try:
        config = config_from_args(args)
    except (OSError, yaml.YAMLError, ValidationError) as error:
        print(f"ddtree-serve serve: error: {error}", file=sys.stderr)
        return 2
    if args.ray_address is None and (problem := config.engine.missing_model_dir()):
        # A local cluster reads the same disk: refuse now instead of failing replicas in a loop.
        print(f"ddtree-serve serve: error: {problem}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        print(f"\nreceived {signal.Signals(signum).name}; shutting down", flush=True)
        stop.set()

    init_options: dict[str, Any] = {"address": args.ray_address, "include_dashboard": False}
    if args.ray_address is None:
        init_options.update(num_cpus=args.num_cpus, num_gpus=args.num_gpus, _temp_dir=args.ray_temp_dir)
    ray.init(**{key: value for key, value in init_options.items() if value is not None})
    # After ray.init: Ray installs its own SIGTERM handler there, which would skip our shutdown.
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(**serve_start_options(config))
        serve.run(build_app(config), name=config.app_name, route_prefix="/", blocking=False)
        print(
            f"ddtree-serve: model {config.model_name!r} ({config.engine.mode}, budget {config.engine.budget})"
        )
        print(f"  HTTP  http://{config.http.host}:{config.http.port}/v1  (OpenAI-compatible)")
        # Ray Serve's gRPC proxy takes no host: it listens on every interface ([::]).
        print(f"  gRPC  127.0.0.1:{config.grpc.port}  (ddtree_serve.v1.DDTreeServe; all interfaces)")
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
