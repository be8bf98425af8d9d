"""The served app with the target inside the Coordinator replica and the drafter in its actor
(`placement.workers: target_in_coordinator`): a real local Ray cluster with fake GPUs, the
deployed application, real HTTP and gRPC clients, and a drafter killed under load.

The bundled pair (a trained drafter, so speculation is visible in tau); every output must equal
the in-process engine's greedy output.
"""

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from ddtree_serve.engine.llm import LLM
from ddtree_serve.serve.protos import DDTreeServeStub
from tests.conftest import TinyModelDirs
from tests.serve.conftest import (
    ServeCluster,
    on_the_bundled_pair,
    on_two_fake_gpus,
    start_serve_cluster,
    tiny_serve_config,
)
from tests.serve.test_faults import (
    completion_body,
    greedy,
    group_identity,
    grpc_stream,
    health,
    http_stream,
    stream_text,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n", "for i in range(10):"]
STREAM_TOKENS = 160  # long enough that the kill lands mid-stream


def bundled_group(tiny_model_dirs: TinyModelDirs, workers: str, **placement: Any) -> Iterator[ServeCluster]:
    """The bundled pair served with `placement.workers` `workers` on two fake GPUs (this module's
    group and the engine cores'), `placement`'s other fields merged in."""
    raw = tiny_serve_config(
        tiny_model_dirs,
        engine={"max_seq_len": 512, "max_num_seqs": 4, "max_queue_len": 8, "budget": 8},
        placement=on_two_fake_gpus(workers=workers, **placement),
    )
    yield from start_serve_cluster(on_the_bundled_pair(raw), num_gpus=2)


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs: TinyModelDirs) -> Iterator[ServeCluster]:
    yield from bundled_group(tiny_model_dirs, "target_in_coordinator")


async def _streams(cluster: ServeCluster, client: httpx.AsyncClient, stub: Any) -> list[asyncio.Task]:
    """Every prompt streamed at once, HTTP and gRPC in turn."""
    return [
        asyncio.create_task(
            http_stream(client, cluster.http_url, prompt, STREAM_TOKENS)
            if i % 2 == 0
            else grpc_stream(stub, prompt, STREAM_TOKENS)
        )
        for i, prompt in enumerate(PROMPTS)
    ]


def test_the_replica_holds_the_targets_gpu_and_only_the_drafter_is_an_actor(cluster: ServeCluster) -> None:
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    bundles = [[dict(b) for b in g["bundles"].values()] for g in groups]
    assert [{"CPU": 0.5, "GPU": 1.0}, {"CPU": 0.25, "GPU": 1.0}] in bundles
    assert ray.available_resources().get("GPU", 0) == 0  # the replica's and the drafter's
    assert set(group_identity(cluster)) == {"drafter"}


def test_http_and_grpc_streams_equal_the_in_process_engine_and_speculate(
    cluster: ServeCluster, reference: LLM
) -> None:
    check_streams_equal_in_process(cluster, reference)


def test_killing_the_drafter_loses_no_request_and_the_group_stays_healthy(
    cluster: ServeCluster, reference: LLM
) -> None:
    check_a_drafter_kill_loses_no_request(cluster, reference)


def check_streams_equal_in_process(cluster: ServeCluster, reference: LLM) -> None:
    """Every prompt streamed at once over HTTP and gRPC, and one completion, equal the in-process
    engine's greedy text, and the drafter drafts (a group whose drafter is an actor)."""
    expected = [o.text for o in reference.generate(PROMPTS, greedy(STREAM_TOKENS))]

    async def run() -> tuple[list[Any], dict[str, Any]]:
        async with (
            httpx.AsyncClient(timeout=300) as client,
            grpc.aio.insecure_channel(cluster.grpc_target) as channel,
        ):
            results = await asyncio.gather(*await _streams(cluster, client, DDTreeServeStub(channel)))
            response = await client.post(
                f"{cluster.http_url}/v1/completions", json=completion_body(PROMPTS[0], 48)
            )
            assert response.status_code == 200, response.text
            return list(results), response.json()

    results, single = asyncio.run(run())
    assert [stream_text(r) if isinstance(r, list) else r for r in results] == expected
    assert single["choices"][0]["text"] == reference.generate([PROMPTS[0]], greedy(48))[0].text
    assert single["usage"]["acceptance_length"] > 1.0  # the drafter in its actor does draft


def check_a_drafter_kill_loses_no_request(cluster: ServeCluster, reference: LLM) -> None:
    """A drafter killed under every prompt's stream: each ends with the in-process text, health
    stays 200 throughout, and the group speculates again once Ray restarted it (its first loss)."""
    import ray

    expected = [o.text for o in reference.generate(PROMPTS, greedy(STREAM_TOKENS))]
    drafter = group_identity(cluster)["drafter"]

    async def run() -> tuple[list[Any], list[int], int]:
        async with (
            httpx.AsyncClient(timeout=300) as client,
            grpc.aio.insecure_channel(cluster.grpc_target) as channel,
        ):
            streams = await _streams(cluster, client, DDTreeServeStub(channel))

            async def all_running() -> bool:
                return (await health(client, cluster.http_url))[1]["running"] == len(PROMPTS)

            await wait_until(all_running)
            ray.kill(drafter, no_restart=False)
            statuses = []
            while not all(stream.done() for stream in streams):
                statuses.append((await health(client, cluster.http_url))[0])
                await asyncio.sleep(0.1)
            results = await asyncio.gather(*streams, return_exceptions=True)

            async def speculating_again() -> bool:
                """The engine finds the restarted drafter at a step: one short request a try."""
                response = await client.post(
                    f"{cluster.http_url}/v1/completions", json=completion_body(PROMPTS[0], 4)
                )
                assert response.status_code == 200, response.text
                return (await health(client, cluster.http_url))[1]["speculating"] == 1

            await wait_until(speculating_again)
            losses = (await health(client, cluster.http_url))[1]["drafter_losses"]
            return list(results), statuses, losses

    results, statuses, losses = asyncio.run(run())
    assert not [r for r in results if isinstance(r, BaseException)]
    assert [stream_text(r) if isinstance(r, list) else r for r in results] == expected
    assert set(statuses) == {200}  # a lost drafter never makes the group unhealthy
    assert losses == 1
