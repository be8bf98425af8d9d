"""A multi-node Ray cluster on one machine, for tests and demos of placement and autoscaling.

`ray.cluster_utils.Cluster` starts each node as its own raylet: a head that carries no GPUs
(Serve's controller, proxies and the ingress live there) and `num_gpu_nodes` nodes with fake
GPUs and a node-type resource, so speculation groups land on them only, one STRICT_PACK
placement group per group, and a node can be removed while the service runs. The group nodes
carry no logical CPUs (Ray wants whole numbers): groups placed on them reserve GPUs and the node
type only, and anything that asks for a CPU, the ingress included, stays on the head.
"""

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray._private.utils import get_ray_address_file
from ray.cluster_utils import Cluster

# The name Serve gives each replica's placement group (Ray 2.60): "SERVE_REPLICA::<replica id>".
SERVE_REPLICA_PG_PREFIX = "SERVE_REPLICA::"


@dataclass(frozen=True)
class LocalClusterSpec:
    """The head (no GPUs) and `num_gpu_nodes` identical nodes that host speculation groups."""

    num_gpu_nodes: int = 3
    gpus_per_node: int = 2
    cpus_per_node: int = 0
    head_cpus: int = 1
    node_resources: Mapping[str, float] = field(default_factory=lambda: {"accelerator_type:B300": 1.0})
    object_store_bytes: int = 80 * 1024 * 1024
    metrics_export_port: int | None = None  # the head's Prometheus endpoint
    log_to_driver: bool = True  # replica and worker logs printed by this process


@contextmanager
def local_cluster(spec: LocalClusterSpec, temp_dir: Path) -> Iterator[Cluster]:
    """Starts the nodes and connects this process as the driver; shuts all down on exit."""
    # A second driver joining a local cluster needs token auth off on both sides (Ray 2.60).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    head_args: dict[str, Any] = {
        "num_cpus": spec.head_cpus,
        "num_gpus": 0,
        "include_dashboard": False,
        "object_store_memory": spec.object_store_bytes,
        "temp_dir": str(temp_dir),
        "_system_config": {"metrics_report_interval_ms": 1000},
    }
    if spec.metrics_export_port is not None:
        head_args["metrics_export_port"] = spec.metrics_export_port
    # The head writes its address to Ray's default temp folder whatever `temp_dir` says
    # (Ray 2.60, `write_ray_address`), and fails where that folder was never made (a fresh
    # machine that ran no `ray start`).
    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    # shutdown_at_exit: a node that fails to start is still killed when this process exits.
    cluster = Cluster(initialize_head=True, head_node_args=head_args, shutdown_at_exit=True)
    try:
        for _ in range(spec.num_gpu_nodes):
            add_gpu_node(cluster, spec)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=spec.log_to_driver)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def add_gpu_node(cluster: Cluster, spec: LocalClusterSpec) -> Any:
    """One more group-hosting node (e.g. after one was removed); returns Ray's node object."""
    return cluster.add_node(
        num_cpus=spec.cpus_per_node,
        num_gpus=spec.gpus_per_node,
        resources=dict(spec.node_resources),
        object_store_memory=spec.object_store_bytes,
    )


def group_nodes() -> dict[str, set[str]]:
    """Node ids of every placed speculation group's bundles, by placement group id (CREATED
    Serve replica placement groups only: a pending group has no nodes yet)."""
    groups: dict[str, set[str]] = {}
    for pg_id, info in ray.util.placement_group_table().items():
        if info["name"].startswith(SERVE_REPLICA_PG_PREFIX) and info["state"] == "CREATED":
            groups[pg_id] = set(info["bundles_to_node_id"].values())
    return groups


def node_of(cluster: Cluster, node_id: str) -> Any:
    """The cluster's node object for a Ray node id (what `Cluster.remove_node` takes)."""
    for node in cluster.list_all_nodes():
        if node.node_id == node_id:
            return node
    raise KeyError(f"no node {node_id} in this local cluster")
