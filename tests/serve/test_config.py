"""ServeConfig validation, YAML loading and the placement the Coordinator asks Ray for (no Ray)."""

import argparse
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from ddtree_serve.serve.app import GRPC_SERVICER_FUNCTIONS, serve_start_options
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.coordinator import Coordinator
from ddtree_serve.serve.launcher import add_serve_arguments, config_from_args

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


@pytest.mark.parametrize("num_target_gpus", [1, 2, 4, 8])
def test_one_drafter_gpu_and_a_target_group_of_n_gpus_gives_hand_written_bundles(
    num_target_gpus: int,
) -> None:
    config = ServeConfig.model_validate(
        {
            "placement": {
                "coordinator": {"num_cpus": 1},
                "drafter": {"num_cpus": 1, "num_gpus": 1},
                "target": {
                    "num_cpus": 2,
                    "num_gpus": num_target_gpus,
                    "resources": {"accelerator_type:H200": 0.001},
                },
            }
        }
    )
    options = Coordinator.get_deployment_options(config)
    assert options["placement_group_bundles"] == [
        {"CPU": 1},
        {"CPU": 1, "GPU": 1},
        {"CPU": 2, "GPU": num_target_gpus, "accelerator_type:H200": 0.001},
    ]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"] == {"num_cpus": 1, "resources": {}}
    assert options["num_replicas"] == 1


def test_default_placement_is_cpu_only_with_fractional_cpus() -> None:
    options = Coordinator.get_deployment_options(ServeConfig())
    assert options["placement_group_bundles"] == [{"CPU": 0.25}, {"CPU": 0.25}, {"CPU": 0.25}]
    assert all("GPU" not in bundle for bundle in options["placement_group_bundles"])


def test_mode_ar_has_no_drafter_bundle() -> None:
    config = ServeConfig.model_validate(
        {"engine": {"mode": "ar"}, "placement": {"drafter": {"num_gpus": 1}, "target": {"num_gpus": 2}}}
    )
    assert Coordinator.get_deployment_options(config)["placement_group_bundles"] == [
        {"CPU": 0.25},
        {"CPU": 0.25, "GPU": 2},
    ]


def test_autoscaling_range_becomes_autoscaling_config_and_limits_cover_the_engine_queue() -> None:
    config = ServeConfig.model_validate(
        {
            "engine": {"max_num_seqs": 16, "max_queue_len": 32},
            "autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 12},
        }
    )
    options = Coordinator.get_deployment_options(config)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_ongoing_requests": 12,
    }
    assert options["max_ongoing_requests"] > 16 + 32  # the engine, not Serve, refuses the overflow


@pytest.mark.parametrize(
    "raw",
    [
        {"placement": {"coordinator": {"num_gpus": 1}}},
        {"placement": {"target": {"num_cpus": 0}}},
        {"autoscaling": {"min_replicas": 3, "max_replicas": 2}},
        {"http": {"port": 70000}},
        {"observability": {"tracing": {"exporter": "jaeger"}}},
        {"engine": {"budget": 0}},
        {"unknown_section": {}},
    ],
)
def test_invalid_configs_are_refused(raw: dict) -> None:
    with pytest.raises(ValidationError):
        ServeConfig.model_validate(raw)


@pytest.mark.parametrize("path", sorted(DEPLOYMENTS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_deployment_yaml_validates_and_registers_both_grpc_services(path: Path) -> None:
    config = ServeConfig.from_yaml(path)
    raw = yaml.safe_load(path.read_text())
    assert raw["applications"][0]["import_path"] == "ddtree_serve.serve.app:build_app"
    assert tuple(raw["grpc_options"]["grpc_servicer_functions"]) == GRPC_SERVICER_FUNCTIONS
    assert config.http.port == raw["http_options"]["port"]
    assert config.grpc.port == raw["grpc_options"]["port"]
    assert config.proxy_location == raw.get("proxy_location", "EveryNode")
    assert serve_start_options(config)["proxy_location"] == config.proxy_location
    bundles = Coordinator.get_deployment_options(config)["placement_group_bundles"]
    assert len(bundles) == 2 + len(config.placement.target_bundles())  # coordinator, drafter, target


def test_multi_gpu_yaml_asks_for_one_drafter_gpu_and_four_target_gpus() -> None:
    bundles = Coordinator.get_deployment_options(ServeConfig.from_yaml(DEPLOYMENTS / "multi_gpu.yaml"))[
        "placement_group_bundles"
    ]
    assert bundles == [{"CPU": 2}, {"CPU": 2, "GPU": 1}, {"CPU": 8, "GPU": 4}]


def test_plain_serveconfig_yaml_and_command_line_overrides(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"model_name": "m", "engine": {"budget": 8}, "http": {"port": 8100}}))
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--config", str(path), "--http-port", "8200", "--grpc-port", "9200", "--mode", "chain"]
    )
    config = config_from_args(args)
    assert (config.model_name, config.engine.budget, config.engine.mode) == ("m", 8, "chain")
    assert (config.http.host, config.http.port, config.grpc.port) == ("127.0.0.1", 8200, 9200)
    assert config.stream_batching_interval_ms == 50.0  # Ray Serve LLM's default
    interval = config_from_args(parser.parse_args(["--stream-batching-interval-ms", "0"]))
    assert interval.stream_batching_interval_ms == 0.0
    with pytest.raises(ValidationError):
        config_from_args(parser.parse_args(["--config", str(path), "--budget", "0"]))
    with pytest.raises(ValidationError):
        config_from_args(parser.parse_args(["--stream-batching-interval-ms", "-1"]))
