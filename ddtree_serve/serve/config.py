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
PlacementWorkers = Literal[
    "actors", "target_in_coordinator", "engine_core", "engine_core_colocated", "in_process"
]
"""Where a group's models and engine loop run (`PlacementConfig.workers`; the CLI's choices)."""
PlacementTransport = Literal["auto", "actor_calls", "compiled_graph", "sockets"]
"""How the Coordinator reaches the worker actors (`PlacementConfig.transport`)."""

_SERVE_METRICS_INTERVAL_S = 10.0  # Ray Serve's default metrics_interval_s (2.60)

RAY_SYSTEM_CONFIG: dict[str, Any] = {"timeout_ms_task_wait_for_death_info": 0}
"""Ray system settings that the group's fault handling counts on, for a cluster this process
starts (`ray.init(_system_config=...)`; on a cluster started elsewhere set
`RAY_timeout_ms_task_wait_for_death_info=0` on its nodes, as KubeRay does for a RayService):
a call to an actor that died, and that Ray is restarting, fails at once instead of after a 1 s
grace for news of the death (2 s measured here), so the engine sees a lost worker at once."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerResources(_Strict):
    """Resources of one Ray process (the coordinator replica, the drafter or the target actor)."""

    num_cpus: float = Field(default=0.25, ge=0.0, description="Logical CPUs reserved for the process.")
    num_gpus: float = Field(
        default=0.0,
        ge=0.0,
        description="GPUs reserved for the process (or, for a tensor-parallel target, see "
        "`placement.target`). With tensor_parallel_size 1 a target of N GPUs sets N here (one "
        "actor that owns all N devices).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources, e.g. {'accelerator_type:B300': 0.001} to pin a GPU type.",
    )

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle that holds exactly this process (zero entries dropped)."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in bundle.items() if amount > 0}

    def plus(self, other: "WorkerResources") -> "WorkerResources":
        """One process holding what this one and `other` would reserve apart (a model moved into
        another's process brings its resources)."""
        resources = dict(self.resources)
        for name, amount in other.resources.items():
            resources[name] = resources.get(name, 0.0) + amount
        return WorkerResources(
            num_cpus=self.num_cpus + other.num_cpus,
            num_gpus=self.num_gpus + other.num_gpus,
            resources=resources,
        )


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
        default_factory=WorkerResources,
        description="The TargetWorker actor (target model, KV cache). With tensor_parallel_size N > 1, "
        "either one rank's bundle (num_gpus 1, or 0 for CPU ranks: N bundles, one per rank, as vLLM "
        "and Ray Serve LLM lay them out) or the whole group's (num_gpus N: one bundle, so always one "
        "node even under PACK, its CPUs, GPUs and custom resources shared evenly by the N ranks).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Ranks of the target group (vLLM's and SGLang's name; placement, not engine, "
        "because it sets how many actors and bundles the group has): the target runs as this many "
        "TargetWorker actors, one GPU each, forming one torch.distributed group (NCCL on CUDA, gloo "
        "on CPU) that shards attention heads, MLPs, experts and the vocabulary; the coordinator "
        "still sees one target.",
    )
    workers: PlacementWorkers = Field(
        default="actors",
        description="'actors': DrafterWorker and TargetWorker actors in the group's bundles (the "
        "speculation group); 'target_in_coordinator': the target model inside the Coordinator "
        "replica (which then reserves placement.target's resources in its bundle, as SGLang's "
        "scheduler holds its rank-0 worker) and the drafter in its actor, reached over the socket "
        "step graph: a step's one hop is the draft's; a lost target is a lost replica, which "
        "Serve replaces; 'engine_core': the target model and the engine loop in an EngineCore "
        "actor in the target's bundle (vLLM's engine core: the loop no longer shares a process "
        "with Serve's streams), the drafter in its actor over the socket step graph, the "
        "Coordinator a client of the core; a lost core is a lost replica; "
        "'engine_core_colocated': the engine core with the drafter in its process too (vLLM's "
        "layout, the draft model in the engine's worker; the core reserves placement.target's "
        "and placement.drafter's resources in one bundle and runs both models on engine.device): "
        "no step hop, the fastest served placement when both models share one GPU (README, "
        "Benchmarks); a lost core is a lost replica; 'in_process': both "
        "models inside the Coordinator replica (debugging, Serve's local testing mode).",
    )
    transport: PlacementTransport = Field(
        default="auto",
        description="How the Coordinator reaches the worker actors each step: 'auto' ('sockets' for "
        "one target actor with a drafter, the fastest on one H200 (README, Benchmarks); "
        "'actor_calls' for a tensor-parallel target or mode 'ar'), 'actor_calls' (a Ray "
        "actor call per seam call, features by ObjectRef), 'compiled_graph' (one Ray Compiled "
        "Graph over both actors: shared-memory channels, features target -> drafter inside the "
        "graph, releases batched into the next call) or 'sockets' (the same step graph over TCP "
        "connections the workers open once: Coordinator -> target, Coordinator -> drafter, "
        "target -> drafter; Ray still places, restarts and health-checks the actors). The two "
        "graphs need a drafter (not mode 'ar').",
    )
    features: Literal["auto", "device", "host"] = Field(
        default="auto",
        description="How the target's context features reach the drafter actor: 'device' leaves them "
        "on the GPU behind a CUDA IPC handle when both models lie on the same physical GPU "
        "(fractional num_gpus; a lone target, not a tensor-parallel group); 'auto' does so under "
        "a step graph (transport 'compiled_graph' or 'sockets') for a call's features of 1 MiB "
        "or more and sends smaller ones, and "
        "every call under actor calls (where each handle costs the drafter a call of its own and "
        "one sent while it restarts is never freed), through host memory; 'host' always goes "
        "through host memory. "
        "Across GPUs there is no device path (no NCCL channel).",
    )
    overlap: bool = Field(
        default=False,
        description="Two micro-batches of the running requests in flight: the drafter drafts one "
        "while the target verifies the other (a step costs about max(draft, verify) when the "
        "actors have their own devices). Same tokens as without; needs workers 'actors', a "
        "drafter and the fixed budget policy.",
    )
    chain_drafts: bool = Field(
        default=False,
        description="Under transport 'compiled_graph' or 'sockets' without overlap and with the "
        "fixed budget "
        "policy: each verify execution also runs the drafter's next draft of the same requests "
        "from the verdict (bonus tokens and features stay inside the graph), so a step is one "
        "round trip to the actors instead of two. Same tokens as without; ignored elsewhere. Off "
        "by default: on one H200 it did not make served steps faster (README, Benchmarks).",
    )
    target_max_restarts: int = Field(
        default=3,
        ge=0,
        description="How often Ray restarts a lost target actor in its bundle (one target actor: "
        "tensor_parallel_size 1, workers 'actors') while the Coordinator waits for it and then "
        "serves again over a new engine, the same replica; the requests in flight at the loss "
        "end retriable (503 / UNAVAILABLE). A loss past this count, or a restart that does not "
        "answer within target_restart_timeout_s, fails the replica's health check and Serve "
        "replaces the whole group. 0: every target loss replaces the group.",
    )
    target_restart_timeout_s: float = Field(
        default=120.0,
        gt=0.0,
        description="Longest wait for a restarted target actor (process start and model load) "
        "before Serve replaces the group instead; set it above the target's load time.",
    )
    strategy: PlacementStrategy = Field(
        default="STRICT_PACK",
        description="Placement group strategy; STRICT_PACK keeps a group on one node so features "
        "move over local object transfer.",
    )
    node_type: dict[str, float] = Field(
        default_factory=dict,
        description="Custom resources the node hosting a group must offer, reserved once per group "
        "in its first bundle, e.g. {'accelerator_type:B300': 0.001}: with STRICT_PACK the whole "
        "group lands on such a node. A per-node resource of 1 (e.g. {'ddtree_group_slot': 1} on "
        "nodes started with that much) caps the groups per node.",
    )

    def coordinator_resources(self) -> WorkerResources:
        """What the Coordinator replica reserves: its own, plus the target's when the target
        model runs inside it (workers 'target_in_coordinator')."""
        if self.workers != "target_in_coordinator":
            return self.coordinator
        return self.coordinator.plus(self.target)

    def coordinator_bundle(self) -> dict[str, float]:
        """Bundle 0: the Coordinator replica's resources plus the group's node type."""
        bundle = self.coordinator_resources().bundle()
        for name, amount in self.node_type.items():
            bundle[name] = bundle.get(name, 0.0) + amount
        return {name: amount for name, amount in bundle.items() if amount > 0}

    @model_validator(mode="after")
    def _check_bundles(self) -> "PlacementConfig":
        colocated = self.workers == "engine_core_colocated"
        bundles = {
            "coordinator": self.coordinator_bundle(),  # bundle 0 also holds the node type
            "target": self.target.bundle(),
        }
        if not colocated:  # else the drafter's resources join the core's bundle, if any
            bundles["drafter"] = self.drafter.bundle()
        if colocated and self.drafter.num_gpus >= 1:
            raise ValueError(
                f"placement.drafter.num_gpus {self.drafter.num_gpus} with workers "
                "'engine_core_colocated': both models run on engine.device in the core, so a "
                "GPU of the drafter's own would sit idle; share the target's (e.g. 0.5 each) or "
                "reserve none"
            )
        for role, bundle in bundles.items():
            if not bundle:
                raise ValueError(
                    f"placement.{role} reserves no resources: a placement bundle cannot be empty"
                )
        if self.coordinator.num_gpus > 0:
            raise ValueError(
                "placement.coordinator must not reserve GPUs: the models run in the workers (a target "
                "inside the Coordinator brings placement.target's)"
            )
        if self.tensor_parallel_size > 1:
            if self.target.num_gpus > 1 and self.target.num_gpus != self.tensor_parallel_size:
                raise ValueError(
                    f"placement.target.num_gpus {self.target.num_gpus} with tensor_parallel_size "
                    f"{self.tensor_parallel_size}: one GPU per rank, so 1 (a bundle per rank) or "
                    f"{self.tensor_parallel_size} (one bundle for the group)"
                )
            if self.workers != "actors":
                raise ValueError("placement.tensor_parallel_size > 1 needs workers 'actors' (one per rank)")
        return self

    @property
    def target_in_one_bundle(self) -> bool:
        """The target's ranks share one bundle (target.num_gpus = tensor_parallel_size > 1)."""
        return self.tensor_parallel_size > 1 and self.target.num_gpus > 1

    def target_bundles(self) -> list[dict[str, float]]:
        """The target's placement bundles: one, or one per rank."""
        count = 1 if self.target_in_one_bundle else self.tensor_parallel_size
        return [self.target.bundle() for _ in range(count)]

    def target_rank_resources(self) -> WorkerResources:
        """What one target rank actor reserves inside its bundle."""
        if not self.target_in_one_bundle:
            return self.target
        ranks, target = self.tensor_parallel_size, self.target
        return WorkerResources(
            num_cpus=target.num_cpus / ranks,
            num_gpus=target.num_gpus / ranks,
            resources={name: amount / ranks for name, amount in target.resources.items()},
        )


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


class SpeculationScalingConfig(_Strict):
    """The speculation-aware policy's band (`serve/autoscaling.py`), in slot demand per group.

    Slot demand is (running + queued requests) / max_num_seqs: 1.0 means every KV slot is busy
    and nothing waits. A group's capacity is its slots, not a request count, so the policy sizes
    the group count for `target_slot_demand`, adds groups above `upscale_slot_demand` (or when
    a request waits too long for its first token, or speculation stops paying under load) and
    removes one only when the demand fits the smaller count below `downscale_slot_demand`.
    Between the two thresholds it holds: that gap is the hysteresis.
    """

    target_slot_demand: float = Field(
        default=0.75, gt=0.0, description="Slot demand per group that the policy sizes the count for."
    )
    upscale_slot_demand: float = Field(
        default=1.0, gt=0.0, description="Add groups when the mean slot demand per group exceeds this."
    )
    downscale_slot_demand: float = Field(
        default=0.5,
        ge=0.0,
        description="Remove groups only when the mean slot demand per group is below this and the "
        "demand fits fewer groups at target_slot_demand.",
    )
    max_queue_wait_s: float = Field(
        default=2.0,
        gt=0.0,
        description="Add a group when, averaged over the look-back window, some group's oldest "
        "request has waited this long for its first token (queue + prefill).",
    )
    min_tokens_per_step: float | None = Field(
        default=None,
        gt=0.0,
        description="Add a group when the tokens one request commits per step (tau) fall below "
        "this while slot demand is above downscale_slot_demand: under load the tree budget has "
        "fallen towards 'no draft'. None = off (mode 'ar' always commits 1).",
    )
    max_no_draft_share: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="Add a group when the share of recent steps the adaptive budget decoded "
        "without drafting exceeds this while slot demand is above downscale_slot_demand: the "
        "batch grew past where drafting pays, and smaller batches on more groups draft again. "
        "None = off; the fixed budget policy always reports 0.",
    )

    @model_validator(mode="after")
    def _check_band(self) -> "SpeculationScalingConfig":
        if not self.downscale_slot_demand <= self.target_slot_demand < self.upscale_slot_demand:
            raise ValueError(
                "autoscaling.speculation needs downscale_slot_demand <= target_slot_demand < "
                "upscale_slot_demand (the band the policy holds inside)"
            )
        return self


class AutoscalingConfig(_Strict):
    """Number of speculation groups (Coordinator replicas); min == max means a fixed count.

    `policy: generic` is Ray Serve's own (`target_ongoing_requests` per replica); `speculation`
    scales on what the groups report about their slots, queue and speculation
    (`speculation` section). The delays and windows apply to both; None = Ray Serve's default.
    """

    min_replicas: int = Field(default=1, ge=1, description="Fewest speculation groups.")
    max_replicas: int = Field(default=1, ge=1, description="Most speculation groups.")
    policy: Literal["generic", "speculation"] = Field(
        default="generic",
        description="'generic': Ray Serve's target_ongoing_requests policy; 'speculation': the "
        "slot/queue/tau policy of ddtree_serve.serve.autoscaling.",
    )
    target_ongoing_requests: float = Field(
        default=8.0,
        gt=0.0,
        description="Ongoing requests per group the generic policy aims for (unused by 'speculation').",
    )
    upscale_delay_s: float | None = Field(
        default=None, ge=0.0, description="How long a scale-up must stay wanted before it happens."
    )
    downscale_delay_s: float | None = Field(
        default=None, ge=0.0, description="How long a scale-down must stay wanted before it happens."
    )
    look_back_period_s: float | None = Field(
        default=None, gt=0.0, description="Window over which Serve averages the groups' reports."
    )
    metrics_interval_s: float | None = Field(
        default=None,
        gt=0.0,
        description="How often each group pushes its reports to Serve's controller (Ray 2.60 reads "
        "this deprecated field for the push; short values are for tests and demos).",
    )
    speculation: SpeculationScalingConfig = Field(
        default_factory=SpeculationScalingConfig, description="The band of policy 'speculation'."
    )

    @model_validator(mode="after")
    def _check_range(self) -> "AutoscalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.max_replicas must be >= min_replicas")
        if self.look_back_period_s is not None:
            push_s = self.metrics_interval_s or _SERVE_METRICS_INTERVAL_S
            if self.look_back_period_s <= push_s:
                raise ValueError(
                    f"autoscaling.look_back_period_s ({self.look_back_period_s}) must exceed the push "
                    f"interval metrics_interval_s ({push_s}): the window needs more than one report"
                )
        return self


class HTTPConfig(_Strict):
    host: str = Field(default="127.0.0.1", description="Address the HTTP proxy binds.")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port (OpenAI-compatible API).")


class GRPCConfig(_Strict):
    port: int = Field(default=9000, ge=1, le=65535, description="gRPC port (ddtree_serve.v1.DDTreeServe).")
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
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        default="EveryNode",
        description="Where Serve runs the HTTP/gRPC proxies (Serve's `proxy_location`). A proxy "
        "on a node that goes away takes its open connections with it.",
    )
    stream_batching_interval_ms: float = Field(
        default=50.0,
        ge=0.0,
        description="Ray Serve LLM's setting of that name, and its default: a streamed request sends "
        "at most one chunk per interval after its first (each with every token since the last; the "
        "first and the finished chunk are never held back); 0 = one per step. Each chunk costs the "
        "Coordinator's event loop (Serve's stream protocol), which shares a process with the engine "
        "loop, and the ingress: on one H200 a 100 ms interval took gRPC from 0.62x to 0.72x of "
        "in-process at concurrency 16 and from 0.48x to 0.65x at 64.",
    )
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig, description="Telemetry.")

    @model_validator(mode="after")
    def _check_target_group(self) -> "ServeConfig":
        placement, device = self.placement, self.engine.device
        if placement.tensor_parallel_size == 1:
            return self
        if device not in ("cpu", "cuda"):
            raise ValueError(
                f"engine.device {device!r} with tensor_parallel_size > 1: use 'cuda' "
                "(each rank runs on the GPU Ray gives it) or 'cpu'"
            )
        if device == "cuda" and placement.target_rank_resources().num_gpus != 1:
            raise ValueError(
                "a tensor-parallel target on CUDA needs one GPU per rank: placement.target.num_gpus "
                "1 (a bundle per rank) or tensor_parallel_size (one bundle)"
            )
        return self

    @model_validator(mode="after")
    def _check_transport(self) -> "ServeConfig":
        placement = self.placement
        graph = placement.transport not in ("auto", "actor_calls")
        if placement.tensor_parallel_size > 1 and (graph or placement.overlap):
            raise ValueError(
                "placement.transport 'compiled_graph' / 'sockets' and placement.overlap serve one "
                "target actor: "
                "use them with tensor_parallel_size 1"
            )
        if graph and self.engine.mode == "ar":
            raise ValueError(
                f"placement.transport '{placement.transport}' needs a drafter (mode 'ar' has none)"
            )
        if placement.workers == "engine_core_colocated" and placement.transport != "auto":
            raise ValueError(
                "placement.workers 'engine_core_colocated' has no step hop to transport: "
                "leave placement.transport 'auto'"
            )
        if placement.workers in ("target_in_coordinator", "engine_core"):
            if self.engine.mode == "ar":
                raise ValueError(
                    f"placement.workers '{placement.workers}' needs a drafter (mode 'ar' has none)"
                )
            if placement.transport not in ("auto", "sockets"):
                raise ValueError(
                    f"placement.workers '{placement.workers}' reaches its drafter over transport 'sockets'"
                )
        if placement.overlap:
            if placement.workers in ("in_process", "engine_core_colocated"):
                raise ValueError(
                    "placement.overlap needs workers 'actors', 'target_in_coordinator' or "
                    "'engine_core' (two processes to overlap)"
                )
            if self.engine.mode == "ar" or self.engine.budget_policy != "fixed":
                raise ValueError("placement.overlap needs a drafter and budget_policy 'fixed'")
        return self

    @property
    def transport(self) -> Literal["actor_calls", "compiled_graph", "sockets"]:
        """`placement.transport` with 'auto' resolved: the socket step graph wherever it applies
        (one target actor and a drafter), else actor calls."""
        placement = self.placement
        if placement.transport != "auto":
            return placement.transport
        graph_fits = placement.tensor_parallel_size == 1 and self.engine.mode != "ar"
        return "sockets" if graph_fits else "actor_calls"

    @property
    def max_ongoing_per_group(self) -> int:
        """Requests one Coordinator holds at once: running slots plus the engine's queue."""
        return self.engine.max_num_seqs + self.engine.max_queue_len

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ServeConfig":
        """Reads a plain ServeConfig YAML or a Serve config file (`serve run` format).

        For a Serve config file the first application's `args` are the ServeConfig, and the
        file's `http_options` / `grpc_options` ports fill `http` / `grpc` (and its
        `proxy_location` the field of that name), so one file drives
        both `serve run` and `ddtree-serve serve`.
        """
        raw = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(serve_file_to_args(raw))


def serve_file_to_args(raw: Any) -> dict[str, Any]:
    """The ServeConfig fields described by a YAML document of either supported shape."""
    raw = _mapping(raw, "the config file")
    if "applications" not in raw:
        return raw
    applications = raw["applications"]
    if not isinstance(applications, list) or len(applications) != 1:
        count = len(applications) if isinstance(applications, list) else type(applications).__name__
        raise ValueError(f"expected a list of exactly one application in the Serve config, got {count}")
    application = _mapping(applications[0], "applications[0]")
    args = dict(_mapping(application.get("args") or {}, "applications[0].args"))
    args.setdefault("app_name", application.get("name", "ddtree"))
    http_options = _mapping(raw.get("http_options") or {}, "http_options")
    grpc_options = _mapping(raw.get("grpc_options") or {}, "grpc_options")
    http = dict(_mapping(args.get("http") or {}, "applications[0].args.http"))
    http.update({key: http_options[key] for key in ("host", "port") if key in http_options})
    grpc = dict(_mapping(args.get("grpc") or {}, "applications[0].args.grpc"))
    grpc.update({key: grpc_options[key] for key in ("port", "enable_reflection") if key in grpc_options})
    if http:
        args["http"] = http
    if grpc:
        args["grpc"] = grpc
    if "proxy_location" in raw:
        args["proxy_location"] = raw["proxy_location"]
    return args


def _mapping(value: Any, where: str) -> dict[str, Any]:
    """`value` where the file must hold a mapping (`key: value` lines), or a one-line refusal."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping of settings, got {type(value).__name__}")
    return value
