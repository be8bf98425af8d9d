"""The processes of one speculation group: its placement bundles and the workers it starts.

One Coordinator replica is one group and one placement group. Bundle 0 holds the replica
itself (Serve's rule), then the drafter, then the target group (one bundle, or one per
tensor-parallel rank: `target_group.py`); mode "ar" has no drafter and therefore no drafter
bundle, so the target moves up to bundle 1. The workers are Ray actors in those bundles, the
target inside the replica and the drafter in its actor (placement.workers =
"target_in_coordinator": bundle 0 then also holds the target's resources; `local_target.py`), the
target and the engine loop in an `EngineCore` actor in the target's bundle (placement.workers =
"engine_core"; `engine_core.py`), both models and the loop in that actor (placement.workers =
"engine_core_colocated": one bundle after the replica's holds the target's and the drafter's
resources), or in-process models inside the replica (placement.workers = "in_process");
`placement.transport` picks how the Coordinator reaches the actors (`compiled_graph.py`, over
Ray's channels or the group's own sockets: `step_sockets.py`), and
`placement.features` whether context features may stay on a GPU that both actors share
(`device_features.py`; decided once both workers said where their models lie).

When a worker dies: Ray restarts the drafter in its bundle (the engine decodes plainly until it
is back, then rebuilds its context). Ray restarts a lone target actor too
(`placement.target_max_restarts`), but its KV caches died with it: the requests in flight end,
and the Coordinator builds a new engine over the same actors (`reconnect_workers`). A
tensor-parallel group is never restarted in place (its ranks would have to join a new
torch.distributed group): a lost rank fails health and Serve replaces the whole group.
"""

from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ddtree_serve.engine.builder import DraftStepFactory, TargetStepFactory
from ddtree_serve.engine.interfaces import Drafter, Target
from ddtree_serve.serve.compiled_graph import graph_workers
from ddtree_serve.serve.config import ServeConfig, WorkerResources
from ddtree_serve.serve.device_features import DEVICE_FEATURES_MIN_BYTES, same_gpu
from ddtree_serve.serve.local_target import LocalTarget
from ddtree_serve.serve.target_group import start_target_group
from ddtree_serve.serve.workers import (
    DrafterFactory,
    DrafterWorker,
    RayDrafter,
    RayTarget,
    TargetFactory,
    TargetWorker,
)

# Bundle indices in the group's placement group (bundle 0 is the Coordinator replica).
DRAFTER_BUNDLE, TARGET_BUNDLE = 1, 2
# Ray restarts a lost drafter in its bundle however often it dies (-1: no limit).
DRAFTER_MAX_RESTARTS = -1


def placement_bundles(config: ServeConfig) -> list[dict[str, float]]:
    """The group's placement-group bundles: coordinator (+ node type), drafter (unless mode "ar"),
    target ranks."""
    placement = config.placement
    bundles = [placement.coordinator_bundle()]
    if placement.workers == "engine_core_colocated":
        return [*bundles, colocated_core_resources(config).bundle()]
    if config.engine.mode != "ar":
        bundles.append(placement.drafter.bundle())
    if placement.workers != "target_in_coordinator":  # else bundle 0 holds the target too
        bundles.extend(placement.target_bundles())
    return bundles


def start_workers(
    config: ServeConfig,
    target_factory: TargetFactory | None = None,
    drafter_factory: DrafterFactory | None = None,
) -> tuple[Target, Drafter | None]:
    """The group's target and drafter (None in mode "ar"), as the engine's seam sees them.

    `target_factory` / `drafter_factory` build the in-process models, inside the workers or
    here; None = load `config.engine`'s model directories (tests inject fakes here).
    """
    if target_factory is not None and config.placement.tensor_parallel_size > 1:
        raise ValueError(
            "a target factory builds one process's target; a tensor-parallel group loads its ranks"
        )
    target_factory, drafter_factory = model_factories(config, target_factory, drafter_factory)
    if config.placement.workers in ("engine_core", "engine_core_colocated"):
        raise ValueError("an engine core's group starts with start_engine_core (the engine runs there)")
    if config.placement.workers == "in_process":
        return local_models(target_factory, drafter_factory)
    if config.placement.workers == "target_in_coordinator":
        assert drafter_factory is not None, "the config refuses mode 'ar' here"
        return _start_target_in_coordinator(config, target_factory, drafter_factory)
    return _start_actors(config, target_factory, drafter_factory)


def model_factories(
    config: ServeConfig, target_factory: TargetFactory | None, drafter_factory: DrafterFactory | None
) -> tuple[TargetFactory, DrafterFactory | None]:
    """The factories that build the group's models where they run: the given ones, else
    `config.engine`'s model directories; no drafter in mode "ar"."""
    target_factory = target_factory or TargetStepFactory(config.engine)
    if config.engine.mode == "ar":
        return target_factory, None
    return target_factory, drafter_factory or DraftStepFactory(config.engine)


def local_models(
    target_factory: TargetFactory, drafter_factory: DrafterFactory | None
) -> tuple[Target, Drafter | None]:
    """Both models loaded in this process (`in_process` in the replica, `engine_core_colocated`
    in the core)."""
    return target_factory(), drafter_factory() if drafter_factory is not None else None


def _worker_options(resources: WorkerResources, bundle_index: int) -> dict[str, Any]:
    """A worker actor's options: its resources, in `bundle_index` of this replica's placement
    group (anywhere when there is none)."""
    worker_options: dict[str, Any] = {
        "num_cpus": resources.num_cpus,
        "num_gpus": resources.num_gpus,
        "resources": dict(resources.resources),
    }
    placement_group = get_current_placement_group()
    if placement_group is not None:
        worker_options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index
        )
    return worker_options


def _start_drafter(config: ServeConfig, drafter_factory: DrafterFactory) -> Any:
    """The drafter actor in its bundle; Ray restarts it however often it dies."""
    options = _worker_options(config.placement.drafter, DRAFTER_BUNDLE)
    return DrafterWorker.options(**options, max_restarts=DRAFTER_MAX_RESTARTS).remote(drafter_factory)


def _start_target_in_coordinator(
    config: ServeConfig, target_factory: TargetFactory, drafter_factory: DrafterFactory
) -> tuple[Target, Drafter]:
    """The drafter actor, and the target model loaded here while the actor starts."""
    return local_target_workers(config, target_factory, _start_drafter(config, drafter_factory))


def local_target_workers(
    config: ServeConfig, target_factory: TargetFactory, drafter_actor: Any
) -> tuple[Target, Drafter]:
    """The target model loaded in this process and the drafter actor, over the socket step graph
    (the Coordinator's with `target_in_coordinator`, an `EngineCore`'s with `engine_core`)."""
    target = LocalTarget(target_factory())
    drafter = RayDrafter(drafter_actor)
    _deliver_features(config, target, drafter)
    return graph_workers(target, drafter, config.placement.overlap, "sockets")


def colocated_core_resources(config: ServeConfig) -> WorkerResources:
    """What an `engine_core_colocated` core reserves: the target's resources, plus the drafter's
    unless mode "ar" has none."""
    placement = config.placement
    if config.engine.mode == "ar":
        return placement.target
    return placement.target.plus(placement.drafter)


def start_engine_core(
    config: ServeConfig,
    target_factory: TargetFactory | None = None,
    drafter_factory: DrafterFactory | None = None,
) -> tuple[Any, Any]:
    """The group of `placement.workers: engine_core`: the drafter actor in its bundle and the
    `EngineCore` actor (target model, engine loop) in the target's; of `engine_core_colocated`:
    the core alone in the bundle after the replica's, the drafter model in it too. Returns once
    the core is up -> (core actor, drafter actor or None)."""
    from ddtree_serve.serve.engine_core import EngineCore

    target_factory, drafter_factory = model_factories(config, target_factory, drafter_factory)
    if config.placement.workers == "engine_core_colocated":
        drafter_actor = None
        options = _worker_options(colocated_core_resources(config), DRAFTER_BUNDLE)
    else:
        assert drafter_factory is not None, "the config refuses mode 'ar' here"
        drafter_actor = _start_drafter(config, drafter_factory)
        options = _worker_options(config.placement.target, TARGET_BUNDLE)
    core_actor = ray.remote(EngineCore).options(**options, max_restarts=0)
    core = core_actor.remote(config, drafter_actor, target_factory, drafter_factory)
    ray.get(core.info.remote())  # the core has loaded its models and built its engine
    return core, drafter_actor


def _start_actors(
    config: ServeConfig, target_factory: TargetFactory, drafter_factory: DrafterFactory | None
) -> tuple[Target, Drafter | None]:
    """Starts the workers in this replica's placement group (anywhere when there is none)."""
    placement_group = get_current_placement_group()
    placement = config.placement
    drafter_actor = None
    target_bundle = DRAFTER_BUNDLE
    if drafter_factory is not None:
        drafter_actor = _start_drafter(config, drafter_factory)
        target_bundle = TARGET_BUNDLE
    if placement.tensor_parallel_size > 1:
        drafter = RayDrafter(drafter_actor) if drafter_actor is not None else None
        return start_target_group(config, placement_group, target_bundle), drafter
    target_actor = TargetWorker.options(
        **_worker_options(placement.target, target_bundle), max_restarts=placement.target_max_restarts
    ).remote(target_factory)
    # Both workers start (process, imports, model load) at once; each adapter waits for its own,
    # so a group comes up, or is replaced after a fault, in the time of the slower one.
    target = RayTarget(target_actor)
    if drafter_actor is None:
        return target, None
    drafter = RayDrafter(drafter_actor)
    _deliver_features(config, target, drafter)
    if config.transport != "actor_calls":
        return graph_workers(target, drafter, placement.overlap, config.transport)
    return target, drafter


def _deliver_features(config: ServeConfig, target: RayTarget | LocalTarget, drafter: RayDrafter) -> None:
    """Features by CUDA IPC handle when both models lie on one GPU and the config allows it.

    Under a step graph (Ray's or the sockets') the drafter opens each delivery in its execution.
    Under actor calls the target's adapter has the drafter take each call's handle by a call of
    its own, one more per step, and a handle sent while the drafter restarts is never opened (its
    block stays with the target's process): only `device` asks for that; `auto` keeps actor calls
    on the host path."""
    features = config.placement.features
    graph = config.transport != "actor_calls"
    if features == "host" or (features == "auto" and not graph):
        return
    if not same_gpu(target.device_uuid, drafter.device_uuid):
        return
    min_bytes = DEVICE_FEATURES_MIN_BYTES if features == "auto" else 0
    target.deliver_features_on_device(None if graph else drafter, min_bytes)


def restarts_target_in_place(config: ServeConfig) -> bool:
    """Whether Ray restarts this group's target actor after a loss (else Serve replaces the group)."""
    placement = config.placement
    return (
        placement.workers == "actors"
        and placement.tensor_parallel_size == 1
        and placement.target_max_restarts > 0
    )


def reconnect_workers(
    config: ServeConfig, target_actor: Any, drafter_actor: Any | None
) -> tuple[Target, Drafter | None]:
    """The seam over the group's actors again, for a new engine after Ray restarted the target.

    Blocks until the restarted target answers (`RayActorError` if it is dead for good). Neither
    worker may keep a request of the old engine: the target comes back empty and takes step
    calls only from now on (`RayTarget.start_serving`), and the drafter releases every slot.
    Under the compiled-graph transport a new graph is compiled over both actors.
    """
    target = RayTarget(target_actor)
    target.start_serving(config.engine.max_num_seqs)
    if drafter_actor is None:
        return target, None
    drafter = RayDrafter(drafter_actor)
    drafter.release_all(config.engine.max_num_seqs)
    _deliver_features(config, target, drafter)
    if config.transport != "actor_calls":
        return graph_workers(target, drafter, config.placement.overlap, config.transport)
    return target, drafter
