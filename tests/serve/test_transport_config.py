"""`placement.transport` / `placement.overlap` are validated with the engine they serve."""

import pytest
from pydantic import ValidationError

from ddtree_serve.serve.config import ServeConfig


def test_defaults_are_actor_calls_without_overlap() -> None:
    placement = ServeConfig().placement
    assert (placement.transport, placement.overlap) == ("actor_calls", False)


@pytest.mark.parametrize(
    ("engine", "placement", "message"),
    [
        ({"mode": "ar"}, {"transport": "compiled_graph"}, "needs a drafter"),
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
