"""Serving fixtures: one real local Ray cluster per test module, on free ports and its own temp dir.

Ray allows one cluster per process, so the module that needs a cluster asks for `serve_cluster`
once and shares the deployed application between its tests.
"""

import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.llm import LLM
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.serve.ports import free_ports
from tests.conftest import TinyModelDirs

if TYPE_CHECKING:
    from ddtree_serve.serve.config import ServeConfig

logger = logging.getLogger(__name__)


def tiny_serve_config(dirs: TinyModelDirs, **sections: Any) -> dict[str, Any]:
    """ServeConfig fields for the tiny random pair, small limits, free ports; `sections` merge in."""
    http_port, grpc_port = free_ports(2)
    raw: dict[str, Any] = {
        "model_name": "tiny",
        "engine": {
            "target": str(dirs.target),
            "drafter": str(dirs.drafter),
            "max_seq_len": 256,
            "max_num_seqs": 4,
            "max_queue_len": 8,
            "budget": 16,
        },
        "http": {"port": http_port},
        "grpc": {"port": grpc_port},
    }
    for name, section in sections.items():
        raw[name] = {**raw.get(name, {}), **section} if isinstance(section, dict) else section
    return raw


def on_the_bundled_pair(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with its engine on the bundled pair (a trained drafter, so tau > 1 is visible)."""
    engine = {k: v for k, v in raw["engine"].items() if k not in ("target", "drafter")}
    return {**raw, "engine": engine}


PROXY_PORT_ATTEMPTS = 3


@dataclass(frozen=True)
class ServeCluster:
    http_url: str
    grpc_target: str
    metrics_url: str
    config: "ServeConfig"
    temp_dir: Path


def reference_llm(cluster: ServeCluster) -> LLM:
    """The served engine's config in this process: what served greedy outputs must equal."""
    return LLM.from_config(EngineConfig.model_validate(cluster.config.engine.model_dump()))


def on_two_fake_gpus(**placement: Any) -> dict[str, Any]:
    """`placement` fields of a group whose drafter and target (or engine core) take one fake GPU
    each and little CPU (start the cluster with `num_gpus=2`), `placement` merged in."""
    return {
        "coordinator": {"num_cpus": 0.25},
        "drafter": {"num_cpus": 0.25, "num_gpus": 1},
        "target": {"num_cpus": 0.25, "num_gpus": 1},
        **placement,
    }


@pytest.fixture(scope="module")
def reference(cluster: ServeCluster) -> LLM:
    """The module's served engine config in this process (its `cluster` fixture's): what the
    served greedy outputs must equal."""
    return reference_llm(cluster)


def start_serve_cluster(raw_config: dict[str, Any], num_gpus: int = 0) -> Iterator[ServeCluster]:
    """Starts Ray (fake GPUs: `num_gpus`), Serve with both proxies and the app; tears all down."""
    import ray
    from ray import serve

    from ddtree_serve.serve.app import build_app
    from ddtree_serve.serve.config import RAY_SYSTEM_CONFIG

    taken = {raw_config.get("http", {}).get("port"), raw_config.get("grpc", {}).get("port")}
    metrics_port = next(port for port in free_ports(3) if port not in taken)
    temp_dir = Path(tempfile.mkdtemp(prefix="ddtree-ray-"))
    ray.init(
        num_cpus=2,
        num_gpus=num_gpus,
        include_dashboard=False,
        _temp_dir=str(temp_dir),
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000, **RAY_SYSTEM_CONFIG},
    )
    try:
        config = start_serve_proxies(raw_config)
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        http_url = f"http://127.0.0.1:{config.http.port}"
        _wait_until_healthy(http_url)
        yield ServeCluster(
            http_url=http_url,
            grpc_target=f"127.0.0.1:{config.grpc.port}",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            config=config,
            temp_dir=temp_dir,
        )
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def start_serve_proxies(raw_config: dict[str, Any]) -> "ServeConfig":
    """`serve.start` on `raw_config`'s ports, or on ports drawn again where a proxy could not bind
    one; the ServeConfig it started with.

    A drawn port is only probed, never held (Serve's proxy binds it itself), so another process
    on the host can take it in the seconds Ray takes to start: CI failed once so, on the HTTP
    port. That is the test harness's race, not the app's (the launcher serves the ports it is
    given and checks them before starting Ray), so the harness draws again rather than fail."""
    from ray import serve
    from ray.exceptions import RayTaskError

    from ddtree_serve.serve.app import serve_start_options
    from ddtree_serve.serve.config import ServeConfig

    config = ServeConfig.model_validate(raw_config)
    for _ in range(PROXY_PORT_ATTEMPTS - 1):
        try:
            serve.start(**serve_start_options(config))
            return config
        except RayTaskError as error:
            if "Failed to bind" not in str(error):
                raise
            serve.shutdown()
        http_port, grpc_port = free_ports(2, config.http.host)
        logger.warning(
            "a Serve proxy could not bind port %d or %d; starting again on %d and %d",
            config.http.port,
            config.grpc.port,
            http_port,
            grpc_port,
        )
        config = ServeConfig.model_validate(
            {
                **raw_config,
                "http": {**raw_config.get("http", {}), "port": http_port},
                "grpc": {**raw_config.get("grpc", {}), "port": grpc_port},
            }
        )
    serve.start(**serve_start_options(config))
    return config


def _wait_until_healthy(http_url: str, attempts: int = 120) -> None:
    for _ in range(attempts):
        try:
            if httpx.get(f"{http_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("the application never became healthy")


def run_schedule(
    engine: SpecEngine, schedule: list[tuple[int, str, str, SamplingParams]]
) -> dict[str, list[int]]:
    """Adds each (step, request id, prompt, params) at its step, steps until idle; final tokens."""
    finished: dict[str, list[int]] = {}
    step = 0
    pending = sorted(schedule, key=lambda item: item[0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
        step += 1
    return finished
