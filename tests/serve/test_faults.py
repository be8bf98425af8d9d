"""Actor faults on a real local Ray cluster: a lost drafter loses nothing, a lost target is a
clean, short outage.

One cluster for the module (fake GPUs: the drafter and the target each hold one), serving the
bundled trained pair so that speculation visibly accepts more than one token per step. A lost
target is restarted by Ray in its bundle and the same group serves again over a new engine;
the last test kills the target for good, so Serve replaces the whole group.
The figures each test prints (requests lost, seconds to recovery) are this machine's; the
tests assert behaviour, never times.
"""

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree_serve.engine.llm import LLM
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.serve.protos import DDTreeServeStub, pb2
from tests.conftest import TinyModelDirs
from tests.serve.conftest import (
    ServeCluster,
    on_the_bundled_pair,
    on_two_fake_gpus,
    start_serve_cluster,
    tiny_serve_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "def add(a, b):",
    "import os\n",
    "class Stack:\n",
    "for i in range(10):",
    "def fib(n):",
    "with open(path) as f:",
    "try:\n",
    "return [x for x in",
]
STREAM_TOKENS = 160  # long enough that the kill lands mid-stream
NEW_PROMPTS = ["def main():", "if __name__ =="]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs: TinyModelDirs) -> Iterator[ServeCluster]:
    raw = tiny_serve_config(
        tiny_model_dirs,
        engine={"max_seq_len": 512, "max_num_seqs": 8, "max_queue_len": 8, "budget": 8},
        placement=on_two_fake_gpus(),
    )
    yield from start_serve_cluster(on_the_bundled_pair(raw), num_gpus=2)


def group_identity(cluster: ServeCluster) -> dict[str, Any]:
    """The group's worker actor handles by role: equal handles (same actor ids) = same group."""
    from ray import serve

    coordinator = serve.get_deployment_handle("Coordinator", app_name=cluster.config.app_name)
    return coordinator.worker_actors.remote().result()


def worker_actor(cluster: ServeCluster, role: str) -> Any:
    return group_identity(cluster)[role]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def completion_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


async def http_stream(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, started: asyncio.Event | None = None
) -> list[dict]:
    """Every SSE event of one streamed completion; `started` is set at the first."""
    events = []
    async with client.stream(
        "POST", f"{url}/v1/completions", json=completion_body(prompt, max_tokens, stream=True)
    ) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                if started is not None:
                    started.set()
    return events


def stream_text(events: list[dict]) -> str:
    assert not any("error" in e for e in events), events[-1]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


async def grpc_stream(stub: Any, prompt: str, max_tokens: int, started: asyncio.Event | None = None) -> str:
    """The text of one gRPC stream; `started` is set at its first chunk."""
    request = pb2.GenerateRequest(
        prompt=prompt,
        sampling=pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    parts = []
    async for chunk in stub.Generate(request):
        parts.append(chunk.text)
        if started is not None:
            started.set()
    return "".join(parts)


async def health(client: httpx.AsyncClient, url: str) -> tuple[int, dict[str, Any]]:
    response = await client.get(f"{url}/health", timeout=10)
    return response.status_code, response.json()


async def serving(client: httpx.AsyncClient, url: str) -> bool:
    """Health answers 200; a connection that fails (the group is being replaced) is not yet."""
    try:
        return (await health(client, url))[0] == 200
    except httpx.HTTPError:
        return False


async def wait_until(predicate: Any, timeout_s: float = 60.0, interval_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval_s)
    pytest.fail("condition not reached in time")


# ------------------------------------------------------------------------------------ drafter


def test_killing_the_drafter_loses_no_request_and_speculation_resumes(
    cluster: ServeCluster, reference: LLM
) -> None:
    import ray

    expected = [o.text for o in reference.generate(PROMPTS, greedy(STREAM_TOKENS))]
    expected_new = [o.text for o in reference.generate(NEW_PROMPTS, greedy(NEW_TOKENS))]
    drafter = worker_actor(cluster, "drafter")
    url = cluster.http_url
    timeline: list[tuple[float, int, int]] = []  # (seconds since the kill, speculating, losses)

    async def watch(client: httpx.AsyncClient, kill_time: list[float]) -> None:
        while True:
            status, body = await health(client, url)
            assert status == 200, body  # a lost drafter never makes the group unhealthy
            if kill_time:
                timeline.append(
                    (time.monotonic() - kill_time[0], body["speculating"], body["drafter_losses"])
                )
            await asyncio.sleep(0.1)

    async def new_request(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
        response = await client.post(f"{url}/v1/completions", json=completion_body(prompt, NEW_TOKENS))
        assert response.status_code == 200, response.text
        return response.json()

    async def run() -> tuple[list[Any], list[dict[str, Any]], dict[str, Any], float]:
        async with (
            httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client,
            grpc.aio.insecure_channel(cluster.grpc_target) as channel,
        ):
            stub = DDTreeServeStub(channel)
            streams = [
                asyncio.create_task(
                    http_stream(client, url, p, STREAM_TOKENS)
                    if i % 2 == 0
                    else grpc_stream(stub, p, STREAM_TOKENS)
                )
                for i, p in enumerate(PROMPTS)
            ]

            async def all_running() -> bool:
                return (await health(client, url))[1]["running"] == len(PROMPTS)

            await wait_until(all_running)
            kill_time: list[float] = []
            watcher = asyncio.create_task(watch(client, kill_time))
            ray.kill(drafter, no_restart=False)
            kill_time.append(time.monotonic())
            # New requests while the drafter is gone (sent at once, so they meet the outage).
            new = [asyncio.create_task(new_request(client, p)) for p in NEW_PROMPTS]
            results = await asyncio.gather(*streams, return_exceptions=True)
            new_results = await asyncio.gather(*new)

            async def speculating_again() -> bool:
                """The engine finds the restarted drafter at a step: one short request a try."""
                response = await client.post(f"{url}/v1/completions", json=completion_body(NEW_PROMPTS[1], 4))
                assert response.status_code == 200, response.text
                return (await health(client, url))[1]["speculating"] == 1

            await wait_until(speculating_again)
            resumed_s = time.monotonic() - kill_time[0]
            after = await new_request(client, NEW_PROMPTS[0])
            watcher.cancel()
            return results, new_results, after, resumed_s

    results, new_results, after, resumed_s = asyncio.run(run())
    texts = [stream_text(r) if isinstance(r, list) else r for r in results]
    lost = sum(isinstance(r, BaseException) for r in results)
    outage = [t for t, speculating, _ in timeline if speculating == 0]
    back = [t for t, speculating, _ in timeline if outage and speculating == 1 and t > min(outage)]
    print(
        f"\ndrafter kill: {lost} of {len(PROMPTS)} streams and 0 of {len(NEW_PROMPTS)} new requests "
        f"lost; plain decoding seen from {min(outage, default=-1):.2f} s after the kill, "
        f"speculating again at {min(back, default=resumed_s):.2f} s; streams ended, tau of a new "
        f"request: {after['usage']['acceptance_length']:.2f}"
    )
    assert lost == 0, [r for r in results if isinstance(r, BaseException)]
    assert texts == expected
    assert [r["choices"][0]["text"] for r in new_results] == expected_new
    # The engine did lose the drafter (and decoded plainly for a while), exactly once.
    assert outage and timeline[-1][2] == 1
    # Speculation resumed with a rebuilt context: more than one token per step again.
    assert after["choices"][0]["text"] == expected_new[0]
    assert after["usage"]["acceptance_length"] > 1.0


# ------------------------------------------------------------------------------------- target


def test_killing_the_target_is_a_clean_short_outage(cluster: ServeCluster, reference: LLM) -> None:
    import ray

    target = worker_actor(cluster, "target")
    group = group_identity(cluster)
    restarts_before = httpx.get(f"{cluster.http_url}/health", timeout=10).json()["target_restarts"]
    url = cluster.http_url

    async def whole(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(f"{url}/v1/completions", json=completion_body(PROMPTS[0], 400))

    async def grpc_outcome(stub: Any, started: asyncio.Event) -> grpc.StatusCode:
        try:
            await grpc_stream(stub, PROMPTS[1], 400, started)
        except grpc.aio.AioRpcError as error:
            assert "\n" not in (error.details() or "") and "retry" in (error.details() or "")
            return error.code()
        return grpc.StatusCode.OK

    async def run() -> tuple[httpx.Response, list[dict], grpc.StatusCode, int, Any, float]:
        async with (
            httpx.AsyncClient(timeout=300) as client,
            grpc.aio.insecure_channel(cluster.grpc_target) as channel,
        ):
            stub = DDTreeServeStub(channel)
            started = [asyncio.Event(), asyncio.Event()]  # both streams have sent their headers
            in_flight = [
                asyncio.create_task(whole(client)),
                asyncio.create_task(http_stream(client, url, PROMPTS[2], 400, started[0])),
                asyncio.create_task(grpc_outcome(stub, started[1])),
            ]

            async def all_running() -> bool:
                running = (await health(client, url))[1]["running"] == len(in_flight)
                return running and all(event.is_set() for event in started)

            await wait_until(all_running)
            ray.kill(target, no_restart=False)
            kill_time = time.monotonic()
            response, events, code = await asyncio.gather(*in_flight)
            # Right after the in-flight requests ended, before any Serve health check ran.
            health_status, _ = await health(client, url)
            grpc_health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())

            await wait_until(lambda: serving(client, url), timeout_s=120, interval_s=0.1)
            return response, events, code, health_status, grpc_health.status, time.monotonic() - kill_time

    response, events, code, health_status, grpc_health, recovery_s = asyncio.run(run())
    print(
        f"\ntarget kill: 3 of 3 in-flight requests ended retriable; healthy again {recovery_s:.2f} s "
        "after, same group (target restarted in place)"
    )
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"].isdigit()
    error = response.json()["error"]
    assert error["type"] == "service_unavailable_error" and "\n" not in error["message"]
    assert "target" in error["message"] and "retry" in error["message"]
    stream_errors = [e["error"] for e in events if "error" in e]  # headers were out: in-band
    assert [e["type"] for e in stream_errors] == ["service_unavailable_error"] and stream_errors[0][
        "code"
    ] == "503"
    assert code == grpc.StatusCode.UNAVAILABLE
    assert health_status == 503 and grpc_health == health_pb2.HealthCheckResponse.NOT_SERVING
    # The group is back: a request now gets the right output (in a slot whose drafter context
    # belonged to a request that died with the target: the drafter was reset).
    want = reference.generate(PROMPTS[3], greedy(NEW_TOKENS))[0].text
    ok = httpx.post(f"{url}/v1/completions", json=completion_body(PROMPTS[3], NEW_TOKENS), timeout=120)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] == want
    # ...from the same group: Ray restarted the target actor in place, Serve replaced nothing.
    assert group_identity(cluster) == group
    assert httpx.get(f"{url}/health", timeout=10).json()["target_restarts"] == restarts_before + 1


def test_a_target_lost_while_idle_restarts_in_place_and_every_slot_serves_again(
    cluster: ServeCluster, reference: LLM
) -> None:
    """No request is running, so only the health probes can find the loss; afterwards a full
    batch (every slot, so every drafter slot too) decodes the reference text speculatively."""
    import ray

    group = group_identity(cluster)
    url = cluster.http_url
    restarts_before = httpx.get(f"{url}/health", timeout=10).json()["target_restarts"]
    expected = [o.text for o in reference.generate(PROMPTS, greedy(NEW_TOKENS))]

    async def run() -> tuple[list[dict[str, Any]], float, float]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=16)) as client:
            ray.kill(group["target"], no_restart=False)
            kill_time = time.monotonic()

            async def unhealthy() -> bool:
                return (await health(client, url))[0] == 503

            await wait_until(unhealthy, timeout_s=30, interval_s=0.05)
            down_s = time.monotonic() - kill_time

            async def healthy() -> bool:
                return (await health(client, url))[0] == 200

            await wait_until(healthy, timeout_s=120, interval_s=0.1)
            back_s = time.monotonic() - kill_time
            responses = await asyncio.gather(
                *(client.post(f"{url}/v1/completions", json=completion_body(p, NEW_TOKENS)) for p in PROMPTS)
            )
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
            return [r.json() for r in responses], down_s, back_s

    bodies, down_s, back_s = asyncio.run(run())
    taus = [b["usage"]["acceptance_length"] for b in bodies]
    print(
        f"\nidle target kill: unhealthy {down_s:.2f} s after, healthy again {back_s:.2f} s after; "
        f"then {len(PROMPTS)} requests at once, mean tau {sum(taus) / len(taus):.2f}"
    )
    assert [b["choices"][0]["text"] for b in bodies] == expected
    assert sum(taus) / len(taus) > 1.0  # speculating again, over drafter slots that were reset
    assert group_identity(cluster) == group
    assert httpx.get(f"{url}/health", timeout=10).json()["target_restarts"] == restarts_before + 1


def kill_for_good_mid_request(cluster: ServeCluster, actor: Any) -> tuple[httpx.Response, float]:
    """Kills `actor` (no restart) while one long completion runs -> that request's response, and
    the seconds from the kill until the app serves again (Serve's replacement group)."""
    import ray

    url = cluster.http_url

    async def run() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(timeout=300) as client:
            in_flight = asyncio.create_task(
                client.post(f"{url}/v1/completions", json=completion_body(PROMPTS[0], 400))
            )

            async def running() -> bool:
                return (await health(client, url))[1].get("running") == 1

            await wait_until(running)
            ray.kill(actor, no_restart=True)
            kill_time = time.monotonic()
            response = await in_flight

            await wait_until(lambda: serving(client, url), timeout_s=120, interval_s=0.2)
            return response, time.monotonic() - kill_time

    return asyncio.run(run())


def test_a_target_that_stays_dead_ends_in_serve_replacing_the_group(
    cluster: ServeCluster, reference: LLM
) -> None:
    """Past its restarts (here: killed for good) the target cannot come back in place: the
    request in flight ends retriable, health fails, and Serve's new group serves correctly."""
    group = group_identity(cluster)
    url = cluster.http_url
    response, recovery_s = kill_for_good_mid_request(cluster, group["target"])
    print(f"\ntarget killed for good: Serve's replacement group healthy {recovery_s:.2f} s after")
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"].isdigit() and "retry" in response.json()["error"]["message"]
    replacement = group_identity(cluster)
    assert replacement["target"] != group["target"] and replacement["drafter"] != group["drafter"]
    want = reference.generate(PROMPTS[3], greedy(NEW_TOKENS))[0].text
    ok = httpx.post(f"{url}/v1/completions", json=completion_body(PROMPTS[3], NEW_TOKENS), timeout=120)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] == want
