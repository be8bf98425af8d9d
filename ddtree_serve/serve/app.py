"""`build_app`: one validated `ServeConfig` in, the Ray Serve `Application` out.

Also the `serve run` entry point: `import_path: ddtree_serve.serve.app:build_app` with the
config as the application's `args` (Serve validates them into `ServeConfig` through the typed
argument). The Coordinator declares its own resources, so this stays generic. The target's chat
format (template, end-of-turn stops) is read here, once, and handed to every ingress replica.
"""

from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import HTTPOptions, gRPCOptions

from ddtree_serve.serve.chat import ChatFormat
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.coordinator import Coordinator
from ddtree_serve.serve.ingress import Ingress
from ddtree_serve.serve.placement import report_unplaceable_group
from ddtree_serve.serve.workers import DrafterFactory, TargetFactory

GRPC_SERVICER_FUNCTIONS: tuple[str, ...] = (
    "ddtree_serve.serve.protos.add_DDTreeServeServicer_to_server",
    "ddtree_serve.serve.protos.add_HealthServicer_to_server",
)


def build_app(config: ServeConfig) -> Application:
    """Ingress -> Coordinator (one replica per speculation group), models from `config.engine`.

    Exactly one typed parameter: Serve's rule for `import_path` builders, which then validates
    the YAML `args` into a `ServeConfig`.
    """
    return build_app_with_models(config)


def build_app_with_models(
    config: ServeConfig,
    target_factory: TargetFactory | None = None,
    drafter_factory: DrafterFactory | None = None,
) -> Application:
    """`build_app` with custom in-process model builders for the workers (as in `Coordinator`).

    On a running cluster, a group no node can hold is reported here (`placement.py`).
    """
    if ray.is_initialized():
        report_unplaceable_group(config)
    coordinator = serve.deployment(Coordinator, name="Coordinator").options(
        **Coordinator.get_deployment_options(config)
    )
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.ingress.num_cpus},
    )
    chat = ChatFormat.from_config(config)
    return ingress.bind(coordinator.bind(config, target_factory, drafter_factory), config, chat)


def http_options(config: ServeConfig) -> HTTPOptions:
    return HTTPOptions(host=config.http.host, port=config.http.port)


def grpc_options(config: ServeConfig) -> gRPCOptions:
    return gRPCOptions(
        port=config.grpc.port,
        grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS),
        enable_reflection=config.grpc.enable_reflection,
    )


def serve_start_options(config: ServeConfig) -> dict[str, Any]:
    """Keyword arguments of `serve.start` for the proxies this application needs."""
    return {
        "proxy_location": config.proxy_location,
        "http_options": http_options(config),
        "grpc_options": grpc_options(config),
    }
