"""`ddtree-serve serve` refuses bad configuration with a one-line error and exit code 2, before Ray starts."""

import argparse
import os
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree_serve.cli import main
from ddtree_serve.serve.launcher import (
    add_serve_arguments,
    choose_local_auth_mode,
    choose_serve_mode,
    config_from_args,
    ray_init_options,
)
from ddtree_serve.serve.ports import free_port


@pytest.mark.parametrize(
    ("config_text", "extra_args", "expected"),
    [
        (None, [], "No such file or directory"),
        ("engine: {budget: -3}\n", [], "engine.budget"),
        ("engine: [\n", [], "while parsing"),
        ("http: {port: 70000}\n", [], "http.port"),
        ("grpc: {port: 0}\n", [], "grpc.port: Input should be greater than or equal to 1"),
        (None, ["--target", "/nonexistent-model", "--mode", "ar"], "not a model directory"),
        (None, ["--max-model-len", "4096"], "max_seq_len 4096 is longer than the target's context length"),
        ("42\n", [], "the config file must be a mapping of settings, got int"),
        ("- engine: {}\n", [], "the config file must be a mapping of settings, got list"),
        ("applications: null\n", [], "a list of exactly one application"),
        ("applications: [5]\n", [], "applications[0] must be a mapping"),
        ("applications: [{args: [1, 2]}]\n", [], "applications[0].args must be a mapping"),
        ("applications: [{args: {}}]\nhttp_options: [host, port]\n", [], "http_options must be a mapping"),
    ],
)
def test_bad_serve_configuration_exits_2_with_a_message(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    config_text: str | None,
    extra_args: list[str],
    expected: str,
) -> None:
    args = ["serve", *extra_args]
    if config_text is not None or not extra_args:
        config = tmp_path / "serve.yaml"
        if config_text is not None:
            config.write_text(config_text)
        args += ["--config", str(config)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddtree-serve serve: error:")
    assert expected in err


@pytest.mark.parametrize(
    ("config_text", "expected"),
    [
        ("{not json", "JSONDecodeError"),
        ('{"model_type": "mamba"}', "unsupported model_type 'mamba'"),
        ('{"model_type": "llama"}', "KeyError: 'vocab_size'"),
        ("[]", "AttributeError"),
    ],
)
def test_a_target_config_that_does_not_parse_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config_text: str, expected: str
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(config_text)
    assert main(["serve", "--target", str(target), "--mode", "ar"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ddtree-serve serve: error: target {target / 'config.json'}:")
    assert expected in err and err.count("\n") == 1


def test_joining_a_cluster_deletes_only_this_app_on_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --ray-address the cluster (and its other Serve apps) is not ours to shut down."""
    import ray
    from ray import serve

    from ddtree_serve.serve import app as app_module

    calls: list[str] = []

    def stop_at_deploy(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # leave the serving loop the way Ctrl-C would, right after deploy

    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append("ray.init"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "start", lambda **kwargs: calls.append("serve.start"))
    monkeypatch.setattr(serve, "run", stop_at_deploy)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(serve, "delete", lambda name, **kwargs: calls.append(f"serve.delete {name}"))
    monkeypatch.setattr(app_module, "build_app", lambda config: None)
    assert main(["serve", "--ray-address", "ray://elsewhere:10001", "--mode", "ar"]) == 130
    assert "serve.shutdown" not in calls
    assert any(call.startswith("serve.delete ") for call in calls)


def test_ctrl_c_while_the_app_deploys_stops_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve.run` waits for every replica (a long model load, or a placement that never fits);
    SIGINT there leaves it, cleans up and exits 130 instead of waiting on."""
    import ray
    from ray import serve

    from ddtree_serve.serve import app as app_module

    calls: list[str] = []

    def deploy_for_ever(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, while the deployment waits
        time.sleep(60)
        calls.append("deploy waited to its end")

    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(serve, "run", deploy_for_ever)
    monkeypatch.setattr(serve, "delete", lambda name, **kwargs: calls.append("serve.delete"))
    monkeypatch.setattr(app_module, "build_app", lambda config: None)
    started = time.monotonic()
    assert main(["serve", "--ray-address", "ray://elsewhere:10001", "--mode", "ar"]) == 130
    assert time.monotonic() - started < 30
    assert calls == ["serve.delete", "ray.shutdown"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--budget", "0"], "engine.budget"),
        (["--max-queue-len", "-1"], "engine.max_queue_len"),
        (["--max-model-len", "8"], "engine.max_seq_len"),
        (["--max-num-batched-tokens", "0"], "engine.max_num_batched_tokens"),
        (["--budget-policy", "adaptive", "--mode", "chain"], "needs mode 'ddtree'"),
        (["--budget-policy", "adaptive", "--cost-curve", "/nonexistent/costs.json"], "No such file"),
        (["--workers", "engine_core", "--mode", "ar"], "needs a drafter"),
        (["--workers", "in_process", "--overlap"], "placement.overlap needs workers"),
        (["--tensor-parallel-size", "0"], "placement.tensor_parallel_size"),
    ],
)
def test_bad_flag_values_print_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddtree-serve serve: error:") and expected in err
    assert err.count("\n") == 1  # one line, not pydantic's multi-line report
    assert "Value error" not in err  # a validator's own message, without pydantic's prefix


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--dashboard-port", "70000"], "a port is 1-65535"),
        (["--metrics-export-port", "0"], "a port is 1-65535"),
        (["--num-cpus", "-1"], "finite number >= 0"),
        (["--num-gpus", "nan"], "finite number >= 0"),
    ],
)
def test_ray_flags_out_of_range_are_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str], flags: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2 and expected in capsys.readouterr().err


def test_ports_in_use_or_shared_are_refused_before_ray_starts(
    tiny_target_dir: Path, tiny_drafter_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = ["--target", str(tiny_target_dir), "--drafter", str(tiny_drafter_dir), "--no-dashboard"]
    grpc_port = str(free_port())
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        taken = str(holder.getsockname()[1])
        assert main(["serve", *models, "--http-port", taken, "--grpc-port", grpc_port]) == 2
        assert f"--http-port {taken}: in use on 127.0.0.1" in capsys.readouterr().err
    assert main(["serve", *models, "--http-port", grpc_port, "--grpc-port", grpc_port]) == 2
    assert f"--grpc-port {grpc_port} is also --http-port" in capsys.readouterr().err


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_limit_flags_reach_the_engine_config_and_vllm_names_are_accepted() -> None:
    args = serve_args("--max-model-len", "512", "--max-queue-len", "3", "--max-num-batched-tokens", "256")
    engine = config_from_args(args).engine
    assert (engine.max_seq_len, engine.max_queue_len, engine.max_num_batched_tokens) == (512, 3, 256)
    assert config_from_args(serve_args("--max-seq-len", "300")).engine.max_seq_len == 300


def test_placement_flags_reach_the_config_over_the_file_and_vllm_names_are_accepted(tmp_path: Path) -> None:
    placement = config_from_args(
        serve_args("--workers", "engine_core", "--transport", "sockets", "--overlap")
    ).placement
    assert (placement.workers, placement.transport, placement.overlap) == ("engine_core", "sockets", True)
    assert config_from_args(serve_args("-tp", "2")).placement.tensor_parallel_size == 2
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("placement: {workers: target_in_coordinator, overlap: true}\n")
    from_file = config_from_args(serve_args("--config", str(config_file))).placement
    assert (from_file.workers, from_file.overlap) == ("target_in_coordinator", True)
    flagged = config_from_args(serve_args("--config", str(config_file), "--workers", "engine_core")).placement
    assert (flagged.workers, flagged.overlap) == ("engine_core", True)  # the file's other fields stay
    assert config_from_args(serve_args()).placement.workers == "actors"


def test_a_local_cluster_gets_a_dashboard_on_localhost_unless_turned_off() -> None:
    options = ray_init_options(serve_args("--metrics-export-port", "9100"))
    assert options["include_dashboard"] is True and options["dashboard_host"] == "127.0.0.1"
    assert options["dashboard_port"] == 8265 and options["_metrics_export_port"] == 9100
    assert ray_init_options(serve_args("--no-dashboard"))["include_dashboard"] is False
    assert ray_init_options(serve_args("--ray-address", "ray://elsewhere:10001")) == {
        "address": "ray://elsewhere:10001"
    }


def test_the_serve_throughput_mode_is_set_only_when_asked_and_the_users_choice_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Set, then removed, through monkeypatch: it restores whatever was there before the test.
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "unset")
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED")
    assert choose_serve_mode(False) is None
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ
    assert "throughput-optimized" in (choose_serve_mode(True) or "")
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")
    assert "=0 (from the environment)" in (choose_serve_mode(True) or "")
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"
    assert serve_args("--serve-throughput-optimized").serve_throughput_optimized
    assert not serve_args().serve_throughput_optimized


def test_the_auth_mode_of_a_local_cluster_is_set_explicitly_and_the_users_choice_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "unset")  # so monkeypatch restores the variable after
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert "RAY_AUTH_MODE=token" in choose_local_auth_mode()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert "RAY_AUTH_MODE=disabled (from the environment)" in choose_local_auth_mode()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def test_serve_help_shows_the_default_of_every_flag_that_has_one() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "config", "ray_address"):
            assert action.help and "default" in action.help, action.option_strings
    help_of = {option: action.help for action in parser._actions for option in action.option_strings}
    for flag, value in (
        ("--mode", "ddtree"),
        ("--budget", "32"),
        ("--device", "cpu"),
        ("--max-num-seqs", "8"),
        ("--budget-policy", "fixed"),
        ("--workers", "actors"),
        ("--transport", "auto"),
        ("--tensor-parallel-size", "1"),
    ):
        assert f"(default: {value})" in str(help_of[flag])


def test_budget_flags_reach_the_engine_config_with_the_cost_file_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    engine = config_from_args(serve_args("--budget-policy", "adaptive", "--cost-curve", "costs.json")).engine
    assert engine.budget_policy == "adaptive" and engine.cost_curve == str(tmp_path / "costs.json")
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("engine: {budget_policy: adaptive, cost_curve: /costs/h200.json}\n")
    from_file = config_from_args(serve_args("--config", str(config_file))).engine
    assert (from_file.budget_policy, from_file.cost_curve) == ("adaptive", "/costs/h200.json")
    assert config_from_args(serve_args()).engine.budget_policy == "fixed"


def test_a_cost_curve_that_does_not_load_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "costs.json"
    broken.write_text('{"tokens": [1, 8], "ms": [2.0, 1.0, 3.0]}')  # three times for two points
    assert main(["serve", "--budget-policy", "adaptive", "--cost-curve", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ddtree-serve serve: error: cost curve {broken}:") and err.count("\n") == 1


def test_a_deployment_that_fails_is_one_line_naming_its_cause(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Serve's own error names only the deployments; the replica's exception is the cause."""
    import ray
    from ray import serve

    from ddtree_serve.serve import app as app_module

    def failed_deploy(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "Deploying application ddtree failed: Failed to update the deployments ['Coordinator']."
        )

    replica_traceback = (
        "Traceback (most recent call last):\n  File x, line 1\nSafetensorError: incomplete metadata\n"
    )
    status = SimpleNamespace(
        applications={
            "ddtree": SimpleNamespace(
                deployments={
                    "Ingress": SimpleNamespace(status="DeploymentStatus.HEALTHY", message=""),
                    "Coordinator": SimpleNamespace(status="DEPLOY_FAILED", message=replica_traceback),
                }
            )
        }
    )
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(serve, "run", failed_deploy)
    monkeypatch.setattr(serve, "status", lambda: status)
    monkeypatch.setattr(serve, "delete", lambda name, **kwargs: None)
    monkeypatch.setattr(app_module, "build_app", lambda config: None)
    assert main(["serve", "--ray-address", "ray://elsewhere:10001", "--mode", "ar"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("ddtree-serve serve: error: Deploying application ddtree failed")
    assert err.rstrip().endswith("; Coordinator: SafetensorError: incomplete metadata")


@pytest.mark.parametrize(
    ("raised", "code", "expected"),
    [
        (RuntimeError("Module: bogus does not exist."), 1, "could not join the cluster at bogus://x: Module"),
        (KeyboardInterrupt(), 130, ""),
    ],
)
def test_a_cluster_that_cannot_be_joined_is_one_line_and_ctrl_c_there_exits_130(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    raised: BaseException,
    code: int,
    expected: str,
) -> None:
    import ray

    def init(**kwargs: object) -> None:
        raise raised

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    assert main(["serve", "--ray-address", "bogus://x", "--mode", "ar"]) == code
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and err.count("\n") <= 1
