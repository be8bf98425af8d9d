"""infra/ and deployments/ stay consistent with the code (they are not run in CI: no cluster)."""

from pathlib import Path

import yaml

from ddtree_serve.serve.app import GRPC_SERVICER_FUNCTIONS
from ddtree_serve.serve.config import ServeConfig, serve_file_to_args

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
