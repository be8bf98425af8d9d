"""infra/ and deployments/ stay consistent with the code (they are not run in CI: no cluster)."""

import copy
import gzip
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ddtree_serve.serve import metrics
from ddtree_serve.serve.app import GRPC_SERVICER_FUNCTIONS
from ddtree_serve.serve.config import ServeConfig, serve_file_to_args
from ddtree_serve.serve.group import placement_bundles
from ddtree_serve.serve.placement import group_demand, unplaceable_reason

ROOT = Path(__file__).resolve().parents[2]


def test_rayservice_serve_config_is_the_multi_gpu_deployment() -> None:
    manifest = yaml.safe_load((ROOT / "infra" / "rayservice.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert tuple(serve_config["grpc_options"]["grpc_servicer_functions"]) == GRPC_SERVICER_FUNCTIONS
    in_cluster = ServeConfig.model_validate(serve_file_to_args(serve_config))
    assert in_cluster == ServeConfig.from_yaml(ROOT / "deployments" / "multi_gpu.yaml")
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus = int(workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    group = in_cluster.placement
    assert gpus >= group.drafter.num_gpus + group.target.num_gpus  # a speculation group fits one node


def test_otel_collector_pipelines_use_only_defined_components() -> None:
    collector = yaml.safe_load((ROOT / "infra" / "otel-collector.yaml").read_text())
    for pipeline in collector["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(collector[kind])
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


def test_dockerfile_generates_the_grpc_stubs_at_build_time() -> None:
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text()
    assert "python -m ddtree_serve.serve.protos" in dockerfile
    assert "COPY --chown=ray:users protos ./protos" in dockerfile


def test_grafana_dashboard_queries_only_metrics_the_coordinator_exports() -> None:
    import json
    import re

    from ddtree_serve.serve import metrics

    dashboard = json.loads((ROOT / "infra" / "grafana-dashboard.json").read_text())
    exported = set(re.findall(r'"(ddtree_[a-z_]+)"', Path(metrics.__file__).read_text()))
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"ray_(ddtree_[a-z_]+?)(?:_bucket|_sum|_count|_total)?\b", target["expr"])
    }
    assert queried and queried <= exported, queried - exported


# ------------------------------------------------------------------- RayService and autoscaling


def _rayservice() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "infra" / "rayservice.yaml").read_text())


def _rayservice_schema() -> dict[str, Any]:
    """KubeRay's RayService CRD (tests/serve/data/README.md names its version), `v1` schema."""
    with gzip.open(Path(__file__).parent / "data" / "ray.io_rayservices.yaml.gz", "rt") as crd_file:
        crd = yaml.safe_load(crd_file)
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def test_rayservice_validates_against_the_kuberay_crd_schema() -> None:
    schema = _rayservice_schema()
    validator = jsonschema.Draft7Validator(schema)
    manifest = _rayservice()
    assert list(validator.iter_errors(manifest)) == []
    broken = copy.deepcopy(manifest)
    broken["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Eager"
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "2"
    assert len(list(validator.iter_errors(broken))) == 2  # the schema check has teeth


def _worker_node_resources(worker_group: dict[str, Any]) -> dict[str, float]:
    """What one node of the worker group offers Ray: its pod limits plus custom resources."""
    (container,) = worker_group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    custom = {name: float(amount) for name, amount in worker_group.get("resources", {}).items()}
    return {"CPU": float(limits["cpu"]), "GPU": float(limits["nvidia.com/gpu"]), **custom}


def test_the_b300_worker_group_holds_every_group_serve_may_ask_for() -> None:
    manifest = _rayservice()
    cluster_config = manifest["spec"]["rayClusterConfig"]
    config = ServeConfig.model_validate(serve_file_to_args(yaml.safe_load(manifest["spec"]["serveConfigV2"])))
    (worker_group,) = cluster_config["workerGroupSpecs"]
    node = _worker_node_resources(worker_group)
    assert node.get("accelerator_type:B300") == 1.0
    assert unplaceable_reason(config, [node]) is None  # a whole group fits one node
    group_gpus = group_demand(placement_bundles(config))["GPU"]
    groups_per_node = int(node["GPU"] // group_gpus)
    assert worker_group["maxReplicas"] * groups_per_node >= config.autoscaling.max_replicas
    assert config.autoscaling.policy == "speculation"
    # A node idles out only after the policy's downscale delay has removed its group.
    assert cluster_config["autoscalerOptions"]["idleTimeoutSeconds"] >= config.autoscaling.downscale_delay_s


def test_prometheus_scrapes_the_metrics_export_port_of_every_ray_pod() -> None:
    prometheus = yaml.safe_load((ROOT / "infra" / "prometheus.yaml").read_text())
    (job,) = prometheus["scrape_configs"]
    keeps = {
        tuple(rule["source_labels"]): rule["regex"]
        for rule in job["relabel_configs"]
        if rule.get("action") == "keep"
    }
    port_name = keeps[("__meta_kubernetes_pod_container_port_name",)]
    assert keeps[("__meta_kubernetes_pod_label_ray_io_is_ray_node",)] == "yes"
    cluster_config = _rayservice()["spec"]["rayClusterConfig"]
    for group in [cluster_config["headGroupSpec"], *cluster_config["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
        assert ports[port_name] == int(group["rayStartParams"]["metrics-export-port"])


def test_grafana_dashboard_shows_the_autoscaling_policys_inputs_and_decisions() -> None:
    dashboard = json.loads((ROOT / "infra" / "grafana-dashboard.json").read_text())
    exprs = " ".join(target["expr"] for panel in dashboard["panels"] for target in panel["targets"])
    policy_metrics = set(re.findall(r'"(ddtree_autoscaling_[a-z_]+)"', Path(metrics.__file__).read_text()))
    assert len(policy_metrics) == 6
    assert all(f"ray_{name}" in exprs for name in policy_metrics), policy_metrics


def test_grafana_dashboard_shows_the_adaptive_budgets_choice_and_its_calibration() -> None:
    dashboard = json.loads((ROOT / "infra" / "grafana-dashboard.json").read_text())
    exprs = " ".join(target["expr"] for panel in dashboard["panels"] for target in panel["targets"])
    budget_metrics = ("budget_nodes", "budget_no_draft_steps", "predicted_acceptance", "actual_acceptance")
    for name in (*budget_metrics, "calibration_abs_error"):
        assert f'"ddtree_{name}"' in Path(metrics.__file__).read_text(), name
        assert f"ray_ddtree_{name}" in exprs, name
