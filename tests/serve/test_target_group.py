"""The tensor-parallel target group: its placement, a served TP=2 request, and a rank that dies.

The Ray tests share one local cluster (fake GPUs: drafter + two target ranks, gloo on CPU)
serving the tiny pair through a TP=2 group. One rank-death test starts a second TP=2 group of
CPU ranks from the driver, behind an in-process engine, and kills one of its ranks mid-request;
the last test kills a rank of the served group mid-stream and waits for Serve to replace it.
"""

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
import torch
from pydantic import ValidationError

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.async_llm import AsyncLLM, EngineDeadError
from ddtree_serve.engine.builder import target_dir
from ddtree_serve.engine.interfaces import PrefillInput, SamplingBatch
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.coordinator import Coordinator
from ddtree_serve.serve.target_group import TargetGroupError, start_target_group
from tests.conftest import TinyModelDirs
from tests.serve.conftest import (
    ServeCluster,
    on_two_fake_gpus,
    reference_llm,
    start_serve_cluster,
    tiny_serve_config,
)

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"
PROMPTS = ["def add(a, b):", "The quick brown fox"]
MAX_TOKENS = 24


def test_one_drafter_gpu_and_a_tp4_target_gives_hand_written_bundles() -> None:
    config = ServeConfig.model_validate(
        {
            "engine": {"device": "cuda"},
            "placement": {
                "coordinator": {"num_cpus": 1},
                "drafter": {"num_cpus": 2, "num_gpus": 1},
                "target": {"num_cpus": 4, "num_gpus": 1, "resources": {"accelerator_type:H200": 0.001}},
                "tensor_parallel_size": 4,
            },
        }
    )
    options = Coordinator.get_deployment_options(config)
    rank = {"CPU": 4, "GPU": 1, "accelerator_type:H200": 0.001}
    assert options["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 2, "GPU": 1}, rank, rank, rank, rank]
    assert options["placement_group_strategy"] == "STRICT_PACK"


def test_a_target_bundle_of_n_gpus_holds_all_n_ranks_on_one_node() -> None:
    config = ServeConfig.model_validate(
        {
            "engine": {"device": "cuda"},
            "placement": {
                "drafter": {"num_cpus": 4, "num_gpus": 1},
                "target": {"num_cpus": 32, "num_gpus": 8, "resources": {"accelerator_type:B300": 0.008}},
                "tensor_parallel_size": 8,
                "strategy": "PACK",
            },
        }
    )
    bundles = Coordinator.get_deployment_options(config)["placement_group_bundles"]
    assert bundles == [
        {"CPU": 0.25},
        {"CPU": 4, "GPU": 1},
        {"CPU": 32, "GPU": 8, "accelerator_type:B300": 0.008},
    ]
    rank = config.placement.target_rank_resources()
    assert (rank.num_cpus, rank.num_gpus, rank.resources) == (4, 1, {"accelerator_type:B300": 0.001})


def test_multi_gpu_tp_yaml_asks_for_one_drafter_gpu_and_four_one_gpu_ranks() -> None:
    config = ServeConfig.from_yaml(DEPLOYMENTS / "multi_gpu_tp.yaml")
    bundles = Coordinator.get_deployment_options(config)["placement_group_bundles"]
    assert bundles == [{"CPU": 2}, {"CPU": 2, "GPU": 1}, *[{"CPU": 4, "GPU": 1}] * 4]
    assert ServeConfig.from_yaml(DEPLOYMENTS / "local_tp.yaml").placement.tensor_parallel_size == 2


def test_mode_ar_puts_the_ranks_right_after_the_coordinator() -> None:
    config = ServeConfig.model_validate(
        {"engine": {"mode": "ar"}, "placement": {"target": {"num_gpus": 1}, "tensor_parallel_size": 2}}
    )
    bundles = Coordinator.get_deployment_options(config)["placement_group_bundles"]
    assert bundles == [{"CPU": 0.25}, {"CPU": 0.25, "GPU": 1}, {"CPU": 0.25, "GPU": 1}]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"placement": {"target": {"num_gpus": 3}, "tensor_parallel_size": 2}}, "one GPU per rank"),
        ({"placement": {"workers": "in_process", "tensor_parallel_size": 2}}, "needs workers 'actors'"),
        (
            {
                "engine": {"device": "cuda:1"},
                "placement": {"target": {"num_gpus": 1}, "tensor_parallel_size": 2},
            },
            "use 'cuda'",
        ),
        ({"engine": {"device": "cuda"}, "placement": {"tensor_parallel_size": 2}}, "num_gpus 1"),
    ],
)
def test_impossible_target_groups_are_refused(raw: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServeConfig.model_validate(raw)


# ---------------------------------------------------------------------------- on a Ray cluster


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs: TinyModelDirs) -> Iterator[ServeCluster]:
    raw = tiny_serve_config(
        tiny_model_dirs,
        placement=on_two_fake_gpus(tensor_parallel_size=2),
        observability={"metrics": False},
    )
    yield from start_serve_cluster(raw, num_gpus=3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_served_greedy_completion_through_a_tp2_group_equals_the_in_process_engine(
    cluster: ServeCluster,
) -> None:
    reference = reference_llm(cluster)
    expected = reference.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for prompt, want in zip(PROMPTS, expected, strict=True):
        response = httpx.post(
            f"{cluster.http_url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == want.text
        assert body["usage"]["completion_tokens"] == len(want.token_ids)


async def _first_then_rest(llm: AsyncLLM, prompt_ids: list[int], after_first: object) -> list[object]:
    """Stream one request; call `after_first()` once its first output arrived; collect the rest."""
    outputs = []
    async for output in llm.generate_stream(
        prompt_ids, SamplingParams(max_tokens=200, temperature=0.0), "r0"
    ):
        outputs.append(output)
        if len(outputs) == 1:
            after_first()  # type: ignore[operator]
    return outputs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_dies_takes_its_group_down_with_a_clear_error(cluster: ServeCluster) -> None:
    # plain decoding ("ar"): one target call per token, and no drafter to start
    engine_config = EngineConfig.model_validate(
        {**cluster.config.engine.model_dump(), "max_seq_len": 512, "mode": "ar"}
    )
    config = ServeConfig.model_validate(
        {
            "engine": engine_config.model_dump(),
            "placement": {"target": {"num_cpus": 0.1}, "tensor_parallel_size": 2},
        }
    )
    group = start_target_group(config, None, 0)  # CPU ranks, anywhere on the cluster
    engine = SpecEngine(engine_config.to_settings(), group, None, load_tokenizer(target_dir(engine_config)))
    llm = AsyncLLM(engine)
    prompt_ids = llm.tokenizer.encode(PROMPTS[0]).ids
    try:
        # the request in flight gets the group's error, naming the rank, and nothing hangs
        with pytest.raises(EngineDeadError, match="target rank 1 of 2 failed"):
            asyncio.run(
                asyncio.wait_for(_first_then_rest(llm, prompt_ids, lambda: ray.kill(group.ranks[1])), 120)
            )
        assert not llm.is_running
        # the surviving rank was killed with it (it would wait in its collective otherwise)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group.ranks[0].describe.remote(), timeout=60)
        greedy = SamplingBatch(torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.ones(1), True)
        with pytest.raises(TargetGroupError, match="target rank 1 of 2 failed"):
            group.prefill(PrefillInput([0], [prompt_ids], greedy, None))
    finally:
        llm.shutdown()
        group.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_served_group_whose_rank_dies_fails_the_stream_in_flight_and_serve_restarts_it(
    cluster: ServeCluster,
) -> None:
    """Runs last: it takes the module's served group down and waits for its replacement."""
    url = f"{cluster.http_url}/v1/completions"
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
    old_ranks = _served_rank_names()
    assert len(old_ranks) == 2
    events = []
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 1:
                    name, namespace = old_ranks[1]
                    ray.kill(ray.get_actor(name, namespace=namespace))
    assert "target rank" in events[-1]["error"]["message"], events[-1]
    assert "choices" in events[0]  # the stream had started: the error reached a request in flight
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # Serve replaces the replica: a new group, new ranks
        new_ranks = _served_rank_names()
        healthy = httpx.get(f"{cluster.http_url}/health", timeout=10).status_code == 200
        if healthy and len(new_ranks) == 2 and not set(new_ranks) & set(old_ranks):
            break
        time.sleep(1.0)
    else:
        pytest.fail("the group was not restarted")
    response = httpx.post(url, json={**body, "stream": False, "max_tokens": 8}, timeout=120)
    assert response.status_code == 200, response.text


def _served_rank_names() -> list[tuple[str, str]]:
    """(name, namespace) of the live rank actors of the served group, rank order."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted((a["name"], a["namespace"]) for a in actors if a["name"].startswith("ddtree-target-"))
