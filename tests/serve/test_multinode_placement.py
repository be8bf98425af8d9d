"""Whether a node can hold a whole speculation group, and what the report names when none can
(no Ray: node totals as `ray.nodes()` gives them)."""

from pathlib import Path

from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.group import placement_bundles
from ddtree_serve.serve.placement import group_demand, unplaceable_reason

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"

B300_NODE = {"CPU": 224.0, "GPU": 8.0, "accelerator_type:B300": 1.0, "memory": 2e12}
H200_NODE = {"CPU": 128.0, "GPU": 8.0, "accelerator_type:H200": 1.0}


def b300_group(**placement: object) -> ServeConfig:
    raw = {
        "placement": {
            "coordinator": {"num_cpus": 4},
            "drafter": {"num_cpus": 4, "num_gpus": 1},
            "target": {"num_cpus": 32, "num_gpus": 4},
            "node_type": {"accelerator_type:B300": 0.001},
            **placement,
        }
    }
    return ServeConfig.model_validate(raw)


def test_the_node_type_is_reserved_once_in_the_first_bundle() -> None:
    bundles = placement_bundles(b300_group())
    assert bundles[0] == {"CPU": 4, "accelerator_type:B300": 0.001}
    assert all("accelerator_type:B300" not in bundle for bundle in bundles[1:])
    assert group_demand(bundles) == {"CPU": 40, "GPU": 5, "accelerator_type:B300": 0.001}


def test_a_group_fits_a_node_of_its_type() -> None:
    assert unplaceable_reason(b300_group(), [H200_NODE, B300_NODE]) is None


def test_a_cluster_without_the_node_type_is_reported_by_resource_name() -> None:
    reason = unplaceable_reason(b300_group(), [H200_NODE, H200_NODE])
    assert reason is not None
    assert "no node offers enough accelerator_type:B300" in reason
    assert "lacks {accelerator_type:B300: 0.001}" in reason  # the closest node misses only that


def test_strict_pack_needs_the_whole_group_on_one_node_even_if_bundles_fit_apart() -> None:
    small_nodes = [{"CPU": 64.0, "GPU": 4.0, "accelerator_type:B300": 1.0}] * 3  # 4 GPUs each, group needs 5
    reason = unplaceable_reason(b300_group(), small_nodes)
    assert reason is not None and "lacks {GPU: 1}" in reason
    assert unplaceable_reason(b300_group(strategy="PACK"), small_nodes) is None  # bundles fit apart


def test_the_shipped_b300_deployment_needs_b300_nodes() -> None:
    config = ServeConfig.from_yaml(DEPLOYMENTS / "kimi_k2_b300.yaml")
    assert unplaceable_reason(config, [B300_NODE]) is None
    reason = unplaceable_reason(config, [H200_NODE])
    assert reason is not None and "accelerator_type:B300" in reason
