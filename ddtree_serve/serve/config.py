"""`ServeConfig`: the engine config plus everything that makes it a Ray Serve application.

One validated object goes down: the launcher, `serve run` (through the builder's typed
argument) and tests all build a `ServeConfig`; the Coordinator reads placement and limits, the
ingress reads the model name and prompt limits, observability reads its own section.
"""

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ddtree_serve.config import EngineConfig

PlacementStrategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerResources(_Strict):
    """Resources of one Ray process (the coordinator replica, the drafter or the target actor)."""

    num_cpus: float = Field(default=0.25, ge=0.0, description="Logical CPUs reserved for the process.")
    num_gpus: float = Field(
        default=0.0,
        ge=0.0,
        description="GPUs reserved for the process; a target group of N GPUs sets N here "
        "(one actor that owns all N devices).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources, e.g. {'accelerator_type:B300': 0.001} to pin a GPU type.",
    )

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle that holds exactly this process (zero entries dropped)."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in bundle.items() if amount > 0}


class PlacementConfig(_Strict):
    """One speculation group = one placement group: coordinator, drafter device, target devices."""

    coordinator: WorkerResources = Field(
        default_factory=lambda: WorkerResources(num_cpus=0.25),
        description="The Coordinator replica (engine loop, tree building, tokenizer). CPU only.",
    )
    drafter: WorkerResources = Field(
        default_factory=WorkerResources, description="The DrafterWorker actor (DFlash drafter)."
    )
    target: WorkerResources = Field(
        default_factory=WorkerResources, description="The TargetWorker actor (target model, KV cache)."
    )
    workers: Literal["actors", "in_process"] = Field(
        default="actors",
        description="'actors': DrafterWorker and TargetWorker actors in the group's bundles (the "
        "speculation group); 'in_process': both models inside the Coordinator replica (debugging, "
        "Serve's local testing mode).",
    )
    transport: Literal["actor_calls", "compiled_graph"] = Field(
        default="actor_calls",
        description="How the Coordinator reaches the worker actors each step: 'actor_calls' (a Ray "
        "actor call per seam call, features by ObjectRef) or 'compiled_graph' (one Ray Compiled "
        "Graph over both actors: shared-memory channels, features target -> drafter inside the "
        "graph, releases batched into the next call). Needs a drafter (not mode 'ar').",
    )
    overlap: bool = Field(
        default=False,
        description="Two micro-batches of the running requests in flight: the drafter drafts one "
        "while the target verifies the other (a step costs about max(draft, verify) when the "
        "actors have their own devices). Same tokens as without; needs workers 'actors', a "
        "drafter and the fixed budget policy.",
    )
    strategy: PlacementStrategy = Field(
        default="STRICT_PACK",
        description="Placement group strategy; STRICT_PACK keeps a group on one node so features "
        "move over local object transfer.",
    )

    @model_validator(mode="after")
    def _check_bundles(self) -> "PlacementConfig":
        for role in ("coordinator", "drafter", "target"):
            if not getattr(self, role).bundle():
                raise ValueError(
                    f"placement.{role} reserves no resources: a placement bundle cannot be empty"
                )
        if self.coordinator.num_gpus > 0:
            raise ValueError("placement.coordinator must not reserve GPUs: the models run in the workers")
        return self


class IngressConfig(_Strict):
    """The one HTTP + gRPC ingress deployment."""

    num_replicas: int = Field(default=1, ge=1, description="Ingress replicas (stateless, thin).")
    num_cpus: float = Field(default=0.25, ge=0.0, description="Logical CPUs per ingress replica.")
    max_ongoing_requests: int = Field(
        default=256, ge=1, description="Concurrent requests one ingress replica accepts."
    )


class LimitsConfig(_Strict):
    """Request limits enforced at the boundary (the engine also checks its own)."""

    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Longest prompt accepted, in tokens; None (or more) = the engine's own limit, "
        "max_seq_len minus the rows one step's tree takes (budget + 1 for 'ddtree').",
    )
    max_prompt_chars: int = Field(
        default=1_000_000,
        ge=1,
        description="Prompts longer than this many characters are refused before tokenising.",
    )


class AutoscalingConfig(_Strict):
    """Number of speculation groups (Coordinator replicas); min == max means a fixed count."""

    min_replicas: int = Field(default=1, ge=1, description="Fewest speculation groups.")
    max_replicas: int = Field(default=1, ge=1, description="Most speculation groups.")
    target_ongoing_requests: float = Field(
        default=8.0, gt=0.0, description="Ongoing requests per group the autoscaler aims for."
    )

    @model_validator(mode="after")
    def _check_range(self) -> "AutoscalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.max_replicas must be >= min_replicas")
        return self


class HTTPConfig(_Strict):
    host: str = Field(default="127.0.0.1", description="Address the HTTP proxy binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (OpenAI-compatible API).")


class GRPCConfig(_Strict):
    port: int = Field(default=9000, ge=0, le=65535, description="gRPC port (ddtree_serve.v1.DDTreeServe).")
    enable_reflection: bool = Field(default=True, description="Serve gRPC server reflection (grpcurl).")


class TracingConfig(_Strict):
    exporter: Literal["none", "file", "otlp"] = Field(
        default="none", description="Where spans go: nowhere, a JSON-lines file, or an OTLP/HTTP collector."
    )
    file_path: str = Field(
        default="ddtree-spans.jsonl", description="JSON-lines span file (exporter 'file'), one span per line."
    )
    otlp_endpoint: str = Field(
        default="http://127.0.0.1:4318/v1/traces", description="OTLP/HTTP traces endpoint (exporter 'otlp')."
    )
    service_name: str = Field(default="ddtree-serve", description="OpenTelemetry service.name resource.")
    phase_spans: bool = Field(
        default=True, description="Emit draft/build/verify/append spans under every request span."
    )


class ObservabilityConfig(_Strict):
    metrics: bool = Field(
        default=True, description="Record Ray metrics (scraped from Ray's metrics endpoint)."
    )
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry spans.")


class ServeConfig(_Strict):
    """The whole served application: engine, placement, ingress, limits, scaling, ports, telemetry."""

    model_name: str = Field(
        default="ddtree-bundled", min_length=1, description="Name clients pass as `model`."
    )
    app_name: str = Field(default="ddtree", min_length=1, description="Ray Serve application name.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Models, mode, budget, batching.")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="Speculation group resources."
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="HTTP + gRPC ingress.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig, description="Group count.")
    http: HTTPConfig = Field(default_factory=HTTPConfig, description="HTTP proxy address.")
    grpc: GRPCConfig = Field(default_factory=GRPCConfig, description="gRPC proxy address.")
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig, description="Telemetry.")

    @model_validator(mode="after")
    def _check_transport(self) -> "ServeConfig":
        placement = self.placement
        if placement.transport == "compiled_graph" and self.engine.mode == "ar":
            raise ValueError("placement.transport 'compiled_graph' needs a drafter (mode 'ar' has none)")
        if placement.overlap:
            if placement.workers != "actors":
                raise ValueError("placement.overlap needs workers 'actors' (two processes to overlap)")
            if self.engine.mode == "ar" or self.engine.budget_policy != "fixed":
                raise ValueError("placement.overlap needs a drafter and budget_policy 'fixed'")
        return self

    @property
    def max_ongoing_per_group(self) -> int:
        """Requests one Coordinator holds at once: running slots plus the engine's queue."""
        return self.engine.max_num_seqs + self.engine.max_queue_len

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ServeConfig":
        """Reads a plain ServeConfig YAML or a Serve config file (`serve run` format).

        For a Serve config file the first application's `args` are the ServeConfig, and the
        file's `http_options` / `grpc_options` ports fill `http` / `grpc`, so one file drives
        both `serve run` and `ddtree-serve serve`.
        """
        raw = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(serve_file_to_args(raw))


def serve_file_to_args(raw: dict[str, Any]) -> dict[str, Any]:
    """The ServeConfig fields described by a YAML document of either supported shape."""
    if "applications" not in raw:
        return raw
    applications = raw["applications"]
    if len(applications) != 1:
        raise ValueError(f"expected exactly one application in the Serve config, got {len(applications)}")
    application = applications[0]
    args = dict(application.get("args") or {})
    args.setdefault("app_name", application.get("name", "ddtree"))
    http_options = raw.get("http_options") or {}
    grpc_options = raw.get("grpc_options") or {}
    http = dict(args.get("http") or {})
    http.update({key: http_options[key] for key in ("host", "port") if key in http_options})
    grpc = dict(args.get("grpc") or {})
    grpc.update({key: grpc_options[key] for key in ("port", "enable_reflection") if key in grpc_options})
    if http:
        args["http"] = http
    if grpc:
        args["grpc"] = grpc
    return args
