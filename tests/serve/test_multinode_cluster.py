"""A 3-node local Ray cluster (fake GPUs, `accelerator_type:B300` nodes) under the speculation
autoscaling policy: groups spread whole over the nodes, scale up under a load that saturates one
group and back down after the delay, and move when their node is removed; greedy output equals
the in-process engine's throughout.

Each node has 2 fake GPUs and a group takes 2 (drafter 1 + target 1), so at most one group fits
a node and the head (no GPUs, no B300) hosts none. At most 2 groups on 3 nodes: the free node
takes the group whose node is removed. Delays and windows
are short so the module runs in about two minutes on 2 cores. Slow: a real multi-node cluster.
"""

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.llm import LLM
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.serve.app import build_app
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.local_cluster import LocalClusterSpec, group_nodes, local_cluster, node_of
from tests.conftest import TinyModelDirs
from tests.serve.conftest import start_serve_proxies, tiny_serve_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SPEC = LocalClusterSpec(num_gpu_nodes=3, gpus_per_node=2)  # group nodes: no CPUs, the ingress on the head
MAX_GROUPS = 2  # of 3 nodes: the third takes the group whose node is removed
PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport sys", "for i in range(10):"]
MAX_TOKENS = 40
NUM_CLIENTS = 8  # 4x one group's slots (2) plus its queue: saturates one group


@dataclass
class Served:
    cluster: Cluster
    config: ServeConfig
    http_url: str
    reference: dict[str, str] = field(default_factory=dict)  # prompt -> the engine's greedy text


@pytest.fixture(scope="module")
def served(tiny_model_dirs: TinyModelDirs) -> Iterator[Served]:
    raw = tiny_serve_config(
        tiny_model_dirs,
        engine={"max_num_seqs": 2, "max_queue_len": 16},
        placement={
            "coordinator": {"num_cpus": 0},
            "drafter": {"num_cpus": 0, "num_gpus": 1},
            "target": {"num_cpus": 0, "num_gpus": 1},
            "node_type": {"accelerator_type:B300": 0.001},
        },
        ingress={"num_cpus": 0.25},
        autoscaling={
            "policy": "speculation",
            "min_replicas": 1,
            "max_replicas": MAX_GROUPS,
            "upscale_delay_s": 1.0,
            "downscale_delay_s": 4.0,
            "look_back_period_s": 2.0,
            "metrics_interval_s": 0.5,
        },
        observability={"metrics": False},
        # The clients connect to the head's proxy: a proxy on a removed node would take its own
        # connections with it, which is a load balancer's concern, not what is tested here.
        proxy_location="HeadOnly",
    )
    reference_llm = LLM.from_config(EngineConfig.model_validate(raw["engine"]))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = reference_llm.generate(PROMPTS, greedy)
    reference = {prompt: output.text for prompt, output in zip(PROMPTS, outputs, strict=True)}
    temp_dir = Path(tempfile.mkdtemp(prefix="ddtree-multinode-"))
    try:
        with local_cluster(SPEC, temp_dir) as cluster:
            config = start_serve_proxies(raw)
            serve.run(build_app(config), name=config.app_name, route_prefix="/")
            yield Served(cluster, config, f"http://127.0.0.1:{config.http.port}", reference)
            serve.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def complete(served: Served, prompt: str, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(
        f"{served.http_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        timeout=timeout_s,
    )


def running_groups(app_name: str) -> int:
    deployment = serve.status().applications[app_name].deployments["Coordinator"]
    return int(deployment.replica_states.get("RUNNING", 0))


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")


class Load:
    """Client threads that send greedy completions back to back until stopped; every answer is
    kept (status, prompt, text). 503 (queue full) is the service saying "retry"."""

    def __init__(self, served: Served, num_clients: int) -> None:
        self._served = served
        self._stop = threading.Event()
        self.answers: list[tuple[int, str, str]] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(num_clients)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self, index: int) -> None:
        while not self._stop.is_set():
            prompt = PROMPTS[index % len(PROMPTS)]
            try:
                response = complete(self._served, prompt)
            except httpx.HTTPError:
                continue
            text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text
            with self._lock:
                self.answers.append((response.status_code, prompt, text))


def assert_answers_are_greedy(served: Served, answers: list[tuple[int, str, str]]) -> None:
    ok = [(prompt, text) for status, prompt, text in answers if status == 200]
    assert ok, "no request succeeded"
    assert {status for status, _, _ in answers} <= {200, 503}, answers
    for prompt, text in ok:
        assert text == served.reference[prompt]


# ---------------------------------------------------------------------------------------------


def test_each_group_sits_whole_on_one_b300_node(served: Served) -> None:
    wait_for(lambda: len(group_nodes()) >= 1, 60, "the first group")
    b300_nodes = {
        node["NodeID"]
        for node in ray.nodes()
        if node["Alive"] and "accelerator_type:B300" in node["Resources"]
    }
    for nodes in group_nodes().values():
        assert len(nodes) == 1 and nodes <= b300_nodes  # STRICT_PACK on a node of the named type
    response = complete(served, PROMPTS[0])
    assert (
        response.status_code == 200 and response.json()["choices"][0]["text"] == served.reference[PROMPTS[0]]
    )


def test_saturating_load_adds_groups_up_to_the_limit_and_they_go_after_the_delay(served: Served) -> None:
    assert running_groups(served.config.app_name) == 1
    counts = []
    with Load(served, NUM_CLIENTS) as load:

        def at_limit() -> bool:
            counts.append(running_groups(served.config.app_name))
            return counts[-1] == MAX_GROUPS

        wait_for(at_limit, 240, f"{MAX_GROUPS} groups under load")
        # Spread: one group per node, every group on a different node.
        placed = group_nodes()
        assert len(placed) == MAX_GROUPS
        assert len(set.union(*placed.values())) == MAX_GROUPS
        time.sleep(3)  # the new groups serve part of the load
    assert counts == sorted(counts)  # only added while the load lasted
    wait_for(lambda: running_groups(served.config.app_name) == 1, 120, "the scale-down to 1 group")
    assert_answers_are_greedy(served, load.answers)


def test_removing_a_groups_node_moves_the_group_and_the_service_keeps_answering(served: Served) -> None:
    wait_for(lambda: len(group_nodes()) == 1, 60, "one placed group")
    (old_nodes,) = group_nodes().values()
    (old_node,) = old_nodes
    in_flight: list[dict[str, Any]] = []
    started = threading.Barrier(3)

    def stream() -> None:
        events: list[dict[str, Any]] = []
        try:
            with httpx.stream(
                "POST",
                f"{served.http_url}/v1/completions",
                json={
                    "prompt": PROMPTS[1],
                    "max_tokens": 200,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                },
                timeout=120,
            ) as response:
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        events.append(json.loads(line.removeprefix("data: ")))
                        break
                started.wait()
                for line in lines:
                    if line.startswith("data: {"):
                        events.append(json.loads(line.removeprefix("data: ")))
        except httpx.HTTPError as error:
            events.append({"transport_error": type(error).__name__})
        in_flight.append({"events": events})

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for thread in threads:
        thread.start()
    started.wait()  # both streams have their first chunk from the group on old_node
    served.cluster.remove_node(node_of(served.cluster, old_node))
    for thread in threads:
        thread.join(timeout=150)
    assert len(in_flight) == 2  # neither hung
    for request in in_flight:
        last = request["events"][-1]
        # An in-flight request on the removed node ends with a retriable error event (503 /
        # UNAVAILABLE: Serve replaces the group), not a hang, a cut or an internal error.
        assert last.get("error", {}).get("type") == "service_unavailable_error", last

    answers: list[tuple[int, str, str]] = []

    def answered() -> bool:
        try:
            response = complete(served, PROMPTS[2], timeout_s=30)
        except httpx.HTTPError:
            return False
        text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text
        answers.append((response.status_code, PROMPTS[2], text))
        return response.status_code == 200

    wait_for(answered, 180, "an answer after the node was removed", poll_s=1.0)
    assert answers[-1][2] == served.reference[PROMPTS[2]]
    moved = group_nodes()
    assert moved and all(old_node not in nodes and len(nodes) == 1 for nodes in moved.values())
