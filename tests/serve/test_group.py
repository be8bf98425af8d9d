"""The speculation group's start-up: which workers it builds for each mode (no Ray needed in-process)."""

from typing import Any

import pytest

from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.group import placement_bundles, start_workers


class _Built:
    """A factory that records whether it ran and returns a marker object."""

    def __init__(self) -> None:
        self.calls = 0
        self.model = object()

    def __call__(self) -> Any:
        self.calls += 1
        return self.model


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_in_process_group_builds_a_drafter_only_when_the_mode_drafts(mode: str) -> None:
    config = ServeConfig.model_validate({"engine": {"mode": mode}, "placement": {"workers": "in_process"}})
    target_factory, drafter_factory = _Built(), _Built()
    target, drafter = start_workers(config, target_factory, drafter_factory)
    assert target is target_factory.model and target_factory.calls == 1
    if mode == "ar":
        assert drafter is None and drafter_factory.calls == 0
    else:
        assert drafter is drafter_factory.model and drafter_factory.calls == 1
    assert len(placement_bundles(config)) == (2 if mode == "ar" else 3)
