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
