"""`ddtree-serve serve` refuses bad configuration with a one-line error and exit code 2, before Ray starts."""

from pathlib import Path

import pytest

from ddtree_serve.cli import main


@pytest.mark.parametrize(
    ("config_text", "extra_args", "expected"),
    [
        (None, [], "No such file or directory"),
        ("engine: {budget: -3}\n", [], "engine.budget"),
        ("engine: [\n", [], "while parsing"),
        ("http: {port: 70000}\n", [], "http.port"),
        (None, ["--target", "/nonexistent-model", "--mode", "ar"], "not a model directory"),
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
    with pytest.raises(KeyboardInterrupt):
        main(["serve", "--ray-address", "ray://elsewhere:10001", "--mode", "ar"])
    assert "serve.shutdown" not in calls
    assert any(call.startswith("serve.delete ") for call in calls)
