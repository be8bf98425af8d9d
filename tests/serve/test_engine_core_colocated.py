"""The served app with both models and the engine loop in one process (`placement.workers:
engine_core_colocated`): an `EngineCore` actor holding the target and the drafter, no drafter
actor, the Coordinator a client of the core. A real local Ray cluster with fake GPUs, the deployed
application, real HTTP and gRPC clients, a cancelled stream and a core killed mid-request.

The bundled pair (a trained drafter, so speculation is visible in tau); every output must equal
the in-process engine's greedy output.
"""

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ddtree_serve.engine.llm import LLM
from tests.conftest import TinyModelDirs
from tests.serve.conftest import ServeCluster
from tests.serve.test_engine_core import check_a_stream_left_early_frees_its_slot
from tests.serve.test_faults import (
    completion_body,
    greedy,
    group_identity,
    health,
    kill_for_good_mid_request,
)
from tests.serve.test_local_target import PROMPTS, bundled_group, check_streams_equal_in_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs: TinyModelDirs) -> Iterator[ServeCluster]:
    """Half a fake GPU each, as on one real GPU: the core reserves the whole one."""
    yield from bundled_group(
        tiny_model_dirs,
        "engine_core_colocated",
        drafter={"num_cpus": 0.25, "num_gpus": 0.5},
        target={"num_cpus": 0.25, "num_gpus": 0.5},
    )


def test_the_core_holds_both_models_gpus_in_one_bundle_and_no_drafter_actor_starts(
    cluster: ServeCluster,
) -> None:
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    bundles = [[dict(b) for b in g["bundles"].values()] for g in groups]
    assert [{"CPU": 0.25}, {"CPU": 0.5, "GPU": 1.0}] in bundles  # the target's and the drafter's
    assert ray.available_resources().get("GPU", 0) == 1.0  # of the cluster's two
    assert set(group_identity(cluster)) == {"target"}  # the core


def test_http_and_grpc_streams_equal_the_in_process_engine_and_speculate(
    cluster: ServeCluster, reference: LLM
) -> None:
    check_streams_equal_in_process(cluster, reference)
    stats = asyncio.run(_health(cluster))
    assert stats["engine_steps"] > 0 and stats["running"] == stats["waiting"] == 0


def test_a_stream_left_early_frees_its_slot_in_the_core(cluster: ServeCluster) -> None:
    check_a_stream_left_early_frees_its_slot(cluster)


def test_a_core_that_dies_ends_its_request_retriable_and_serve_replaces_the_group(
    cluster: ServeCluster, reference: LLM
) -> None:
    """Both models die with the core: the request in flight ends with a retriable 503 and
    Serve's new group (a new core) serves the in-process text. Runs last: it replaces the
    module's group."""
    core = group_identity(cluster)["target"]
    url = cluster.http_url
    response, _ = kill_for_good_mid_request(cluster, core)
    assert response.status_code == 503, response.text
    assert group_identity(cluster)["target"] != core
    want = reference.generate([PROMPTS[3]], greedy(48))[0].text
    ok = httpx.post(f"{url}/v1/completions", json=completion_body(PROMPTS[3], 48), timeout=120)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] == want


async def _health(cluster: ServeCluster) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as client:
        return (await health(client, cluster.http_url))[1]
