"""The served app with the engine loop in its own process (`placement.workers: engine_core`): the
target and the engine in an `EngineCore` actor, the drafter in its actor, the Coordinator a
client of the core. A real local Ray cluster with fake GPUs, the deployed application, real HTTP
and gRPC clients, a cancelled stream, a refused prompt and a drafter killed under load.

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
from tests.serve.test_faults import (
    completion_body,
    greedy,
    group_identity,
    health,
    kill_for_good_mid_request,
    wait_until,
)
from tests.serve.test_local_target import (
    PROMPTS,
    bundled_group,
    check_a_drafter_kill_loses_no_request,
    check_streams_equal_in_process,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs: TinyModelDirs) -> Iterator[ServeCluster]:
    yield from bundled_group(tiny_model_dirs, "engine_core")


def test_the_core_holds_the_targets_gpu_beside_the_drafter_and_the_replica_holds_none(
    cluster: ServeCluster,
) -> None:
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    bundles = [[dict(b) for b in g["bundles"].values()] for g in groups]
    assert [{"CPU": 0.25}, {"CPU": 0.25, "GPU": 1.0}, {"CPU": 0.25, "GPU": 1.0}] in bundles
    core = group_identity(cluster)["target"]
    info = ray.get(core.info.remote(), timeout=60)  # the target's actor is the core, with the engine
    assert (info.max_seq_len, info.block_size) == (512, 16)


def test_http_and_grpc_streams_equal_the_in_process_engine_and_speculate(
    cluster: ServeCluster, reference: LLM
) -> None:
    check_streams_equal_in_process(cluster, reference)

    async def run() -> tuple[int, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:
            refused = await client.post(
                f"{cluster.http_url}/v1/completions", json=completion_body("a " * 600, 8)
            )
            return refused.status_code, (await health(client, cluster.http_url))[1]

    refused, stats = asyncio.run(run())
    assert refused == 400  # past the core's max_seq_len (its figures, as the client read them)
    assert stats["engine_steps"] > 0 and stats["engine_step_seconds"] > 0.0
    assert stats["running"] == stats["waiting"] == stats["open_streams"] == 0


def test_a_stream_left_early_frees_its_slot_in_the_core(cluster: ServeCluster) -> None:
    check_a_stream_left_early_frees_its_slot(cluster)


def check_a_stream_left_early_frees_its_slot(cluster: ServeCluster) -> None:
    """The abort reaches the engine: the request ends within a few steps of the caller leaving,
    not after the ~400 tokens it asked for (at tau ~2.5, ~160 steps)."""

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


def test_killing_the_drafter_loses_no_request_and_the_group_stays_healthy(
    cluster: ServeCluster, reference: LLM
) -> None:
    check_a_drafter_kill_loses_no_request(cluster, reference)


def test_a_core_that_dies_ends_its_requests_retriable_and_serve_replaces_the_group(
    cluster: ServeCluster, reference: LLM
) -> None:
    """The core holds the target: killing it ends the request in flight with a retriable 503,
    health fails, and Serve's new group (a new core and drafter) serves correctly. Runs last: it
    replaces the module's group."""
    group = group_identity(cluster)
    url = cluster.http_url
    response, _ = kill_for_good_mid_request(cluster, group["target"])
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"].isdigit()
    replacement = group_identity(cluster)
    assert replacement["target"] != group["target"] and replacement["drafter"] != group["drafter"]
    want = reference.generate([PROMPTS[3]], greedy(48))[0].text
    ok = httpx.post(f"{url}/v1/completions", json=completion_body(PROMPTS[3], 48), timeout=120)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] == want
