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
from tests.serve.test_faults import completion_body, greedy, group_identity, health, wait_until
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
    """The abort reaches the core: the request ends within a few steps of the caller leaving,
    not after the ~400 tokens it asked for."""

    async def run() -> tuple[int, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:
            body = completion_body(PROMPTS[1], 400, stream=True)
            async with client.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # leave after the first chunk
            left_at = (await health(client, cluster.http_url))[1]["engine_steps"]

            async def freed() -> bool:
                return (await health(client, cluster.http_url))[1]["running"] == 0

            await wait_until(freed)
            return left_at, (await health(client, cluster.http_url))[1]

    left_at, stats = asyncio.run(run())
    assert stats["running"] == 0 and stats["cancelled"] >= 1
    assert stats["engine_steps"] - left_at < 40


def test_a_core_that_dies_ends_its_request_retriable_and_serve_replaces_the_group(
    cluster: ServeCluster, reference: LLM
) -> None:
    """Both models die with the core: the request in flight ends with a retriable 503 and
    Serve's new group (a new core) serves the in-process text. Runs last: it replaces the
    module's group."""
    import ray

    from tests.serve.test_faults import serving

    core = group_identity(cluster)["target"]
    url = cluster.http_url

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300) as client:
            in_flight = asyncio.create_task(
                client.post(f"{url}/v1/completions", json=completion_body(PROMPTS[0], 400))
            )

            async def running() -> bool:
                return (await health(client, url))[1].get("running") == 1

            await wait_until(running)
            ray.kill(core, no_restart=True)
            response = await in_flight
            await wait_until(lambda: serving(client, url), timeout_s=120, interval_s=0.2)
            return response

    response = asyncio.run(run())
    assert response.status_code == 503, response.text
    assert group_identity(cluster)["target"] != core
    want = reference.generate([PROMPTS[3]], greedy(48))[0].text
    ok = httpx.post(f"{url}/v1/completions", json=completion_body(PROMPTS[3], 48), timeout=120)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] == want


async def _health(cluster: ServeCluster) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as client:
        return (await health(client, cluster.http_url))[1]
