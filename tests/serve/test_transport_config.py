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
    ],
)
def test_combinations_that_cannot_run_are_refused(engine: dict, placement: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServeConfig.model_validate({"engine": engine, "placement": placement})


def test_compiled_graph_with_overlap_is_accepted() -> None:
    config = ServeConfig.model_validate({"placement": {"transport": "compiled_graph", "overlap": True}})
    assert config.placement.overlap
