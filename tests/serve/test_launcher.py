"""`ddtree-serve serve` as a user runs it: start, answer, Ctrl-C, and no Ray process left behind."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ddtree_serve.serve.ports import free_ports
from tests.conftest import TinyModelDirs
from tests.serve.conftest import tiny_serve_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
REPO_ROOT = Path(__file__).resolve().parents[2]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain `text` (Ray passes its temp dir to each)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:160]}")
    return found


@pytest.mark.parametrize("throughput_optimized", [False, True])
def test_serve_command_serves_until_sigint_then_leaves_no_ray_process(
    tiny_model_dirs: TinyModelDirs, tmp_path: Path, throughput_optimized: bool
) -> None:
    """Optimized (`--serve-throughput-optimized`): the banner also names the ingress replica's
    own HTTP server (Ray Serve's direct ingress), and it answers."""
    raw = tiny_serve_config(tiny_model_dirs)
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump({key: raw[key] for key in ("model_name", "engine")}))
    http_port, grpc_port, dashboard_port, metrics_port = free_ports(4)
    ray_dir = tempfile.mkdtemp(prefix="ddtree-launch-")  # short: Ray's socket paths must fit
    command = [
        sys.executable, "-m", "ddtree_serve.serve.launcher", "--config", str(config_path),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--num-cpus", "2", "--ray-temp-dir", ray_dir,
        "--dashboard-port", str(dashboard_port), "--metrics-export-port", str(metrics_port),
        *(["--serve-throughput-optimized"] if throughput_optimized else []),
    ]  # fmt: skip
    inherited = ("RAY_AUTH_MODE", "RAY_SERVE_THROUGHPUT_OPTIMIZED")
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={name: value for name, value in os.environ.items() if name not in inherited},
    )
    printed = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            printed.append(line)
            if "Ctrl-C to stop" in line:
                break
        banner = "".join(printed)
        assert f"http://127.0.0.1:{http_port}/v1" in banner and f":{grpc_port}" in banner, banner[-2000:]
        assert f"dashboard  http://127.0.0.1:{dashboard_port}" in banner, banner[-2000:]
        assert f":{metrics_port}/metrics" in banner and "RAY_AUTH_MODE=" in banner, banner[-2000:]
        # No misleading start-up warnings: the auth mode is set, and the http_options were applied.
        assert "Token authentication is enabled" not in banner and "will not be applied" not in banner
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{dashboard_port}/api/version", timeout=30).status_code in (
            200,
            401,
        )
        response = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60
        )
        assert response.status_code == 200
        direct = re.search(r"direct     http://127\.0\.0\.1:(\d+)/v1", banner)
        assert (direct is not None) == throughput_optimized, banner[-2000:]
        if direct is not None:
            response = httpx.post(
                f"http://127.0.0.1:{direct.group(1)}/v1/completions",
                json={"prompt": "hi", "max_tokens": 4},
                timeout=60,
            )
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        assert processes_mentioning(ray_dir)  # the cluster is really there before Ctrl-C

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
        deadline = time.monotonic() + 30
        while processes_mentioning(ray_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_mentioning(ray_dir) == []
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(ray_dir, ignore_errors=True)
