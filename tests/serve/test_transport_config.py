"""`placement.transport` / `placement.overlap` are validated with the engine they serve."""

import pytest
from pydantic import ValidationError

from ddtree_serve.serve.config import ServeConfig


def test_the_default_transport_is_the_socket_graph_wherever_it_applies() -> None:
    config = ServeConfig()
    assert (config.placement.transport, config.transport, config.placement.overlap) == (
        "auto",
        "sockets",
        False,
    )
    for engine, placement in (
        ({"mode": "ar"}, {}),
        ({}, {"tensor_parallel_size": 2, "target": {"num_cpus": 0.5}}),
    ):
        config = ServeConfig.model_validate({"engine": engine, "placement": placement})
        assert config.transport == "actor_calls"
    explicit = ServeConfig.model_validate({"placement": {"transport": "compiled_graph"}})
    assert explicit.transport == "compiled_graph"


@pytest.mark.parametrize(
    ("engine", "placement", "message"),
    [
        ({"mode": "ar"}, {"transport": "compiled_graph"}, "needs a drafter"),
        ({"mode": "ar"}, {"transport": "sockets"}, "needs a drafter"),
        ({}, {"transport": "sockets", "tensor_parallel_size": 2}, "one target actor"),
        ({"mode": "ar"}, {"overlap": True}, "needs a drafter"),
        ({}, {"overlap": True, "workers": "in_process"}, "workers 'actors'"),
        ({"budget_policy": "adaptive"}, {"overlap": True}, "budget_policy 'fixed'"),
        ({"mode": "ar"}, {"workers": "target_in_coordinator"}, "needs a drafter"),
        ({}, {"workers": "target_in_coordinator", "transport": "compiled_graph"}, "transport 'sockets'"),
        ({}, {"workers": "target_in_coordinator", "transport": "actor_calls"}, "transport 'sockets'"),
        ({}, {"workers": "target_in_coordinator", "tensor_parallel_size": 2}, "needs workers 'actors'"),
        ({"mode": "ar"}, {"workers": "engine_core"}, "needs a drafter"),
        ({}, {"workers": "engine_core", "transport": "compiled_graph"}, "transport 'sockets'"),
        ({}, {"workers": "engine_core", "tensor_parallel_size": 2}, "needs workers 'actors'"),
        ({}, {"workers": "engine_core_colocated", "transport": "sockets"}, "no step hop"),
        ({}, {"workers": "engine_core_colocated", "overlap": True}, "two processes to overlap"),
        ({}, {"workers": "engine_core_colocated", "tensor_parallel_size": 2}, "needs workers 'actors'"),
        ({}, {"workers": "engine_core_colocated", "drafter": {"num_gpus": 1}}, "sit idle"),
    ],
)
def test_combinations_that_cannot_run_are_refused(engine: dict, placement: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServeConfig.model_validate({"engine": engine, "placement": placement})


def test_compiled_graph_with_overlap_is_accepted() -> None:
    config = ServeConfig.model_validate({"placement": {"transport": "compiled_graph", "overlap": True}})
    assert config.placement.overlap


def test_a_target_in_the_coordinator_brings_its_resources_into_bundle_0() -> None:
    """The replica reserves the target's GPU and CPUs beside its own; no target bundle follows."""
    from ddtree_serve.serve.coordinator import Coordinator
    from ddtree_serve.serve.group import placement_bundles

    placement = {
        "workers": "target_in_coordinator",
        "overlap": True,
        "coordinator": {"num_cpus": 0.25, "resources": {"slot": 1.0}},
        "drafter": {"num_cpus": 0.5, "num_gpus": 0.5},
        "target": {"num_cpus": 1.0, "num_gpus": 0.5, "resources": {"slot": 0.5}},
        "node_type": {"accelerator_type:H200": 0.001},
    }
    config = ServeConfig.model_validate({"placement": placement})
    assert config.transport == "sockets"
    assert placement_bundles(config) == [
        {"CPU": 1.25, "GPU": 0.5, "slot": 1.5, "accelerator_type:H200": 0.001},
        {"CPU": 0.5, "GPU": 0.5},
    ]
    actor_options = Coordinator.get_deployment_options(config)["ray_actor_options"]
    assert actor_options == {"num_cpus": 1.25, "num_gpus": 0.5, "resources": {"slot": 1.5}}
    two_actors = ServeConfig.model_validate({"placement": {**placement, "workers": "actors"}})
    assert len(placement_bundles(two_actors)) == 3
    assert "num_gpus" not in Coordinator.get_deployment_options(two_actors)["ray_actor_options"]


def test_an_engine_core_takes_the_targets_bundle_and_the_replica_keeps_its_own() -> None:
    """The core (target and engine loop) is an actor in the target's bundle, as a target actor is;
    the replica reserves only the Coordinator's resources, and the group restarts nothing in place."""
    from ddtree_serve.serve.coordinator import Coordinator
    from ddtree_serve.serve.group import placement_bundles, restarts_target_in_place

    placement = {
        "workers": "engine_core",
        "coordinator": {"num_cpus": 0.25},
        "drafter": {"num_cpus": 0.5, "num_gpus": 0.5},
        "target": {"num_cpus": 1.0, "num_gpus": 0.5},
    }
    config = ServeConfig.model_validate({"placement": placement})
    assert config.transport == "sockets"
    assert placement_bundles(config) == [{"CPU": 0.25}, {"CPU": 0.5, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]
    actor_options = Coordinator.get_deployment_options(config)["ray_actor_options"]
    assert actor_options == {"num_cpus": 0.25, "resources": {}}
    assert not restarts_target_in_place(config)


@pytest.mark.parametrize(
    ("mode", "core_bundle"),
    [("ddtree", {"CPU": 1.5, "GPU": 1.0, "slot": 1.0}), ("ar", {"CPU": 1.0, "GPU": 0.5, "slot": 1.0})],
)
def test_a_colocated_engine_core_reserves_both_models_in_the_bundle_after_the_replicas(
    mode: str, core_bundle: dict[str, float]
) -> None:
    """No drafter bundle: the core that loads the drafter holds its resources (none in mode "ar")."""
    from ddtree_serve.serve.coordinator import Coordinator
    from ddtree_serve.serve.group import placement_bundles, restarts_target_in_place

    placement = {
        "workers": "engine_core_colocated",
        "coordinator": {"num_cpus": 0.25},
        "drafter": {"num_cpus": 0.5, "num_gpus": 0.5},
        "target": {"num_cpus": 1.0, "num_gpus": 0.5, "resources": {"slot": 1.0}},
    }
    config = ServeConfig.model_validate({"engine": {"mode": mode}, "placement": placement})
    assert placement_bundles(config) == [{"CPU": 0.25}, core_bundle]
    actor_options = Coordinator.get_deployment_options(config)["ray_actor_options"]
    assert actor_options == {"num_cpus": 0.25, "resources": {}}
    assert not restarts_target_in_place(config)


def test_a_colocated_drafter_may_reserve_nothing_of_its_own():
    """Its model runs in the core: a drafter of no resources is no empty bundle there."""
    from ddtree_serve.serve.group import placement_bundles

    placement = {"workers": "engine_core_colocated", "drafter": {"num_cpus": 0}}
    assert placement_bundles(ServeConfig.model_validate({"placement": placement}))[1] == {"CPU": 0.25}
    with pytest.raises(ValidationError, match="cannot be empty"):
        ServeConfig.model_validate({"placement": {**placement, "workers": "engine_core"}})
