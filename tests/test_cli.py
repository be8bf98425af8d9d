"""`ddtree-serve` CLI: generate (streamed text or JSON), stdin prompts, help, bad values."""

import io
import json
import subprocess
import sys

import pytest

from ddtree_serve.cli import main


@pytest.fixture(scope="module")
def model_args(tiny_target_dir, tiny_drafter_dir) -> list[str]:
    return ["--target", str(tiny_target_dir), "--drafter", str(tiny_drafter_dir)]


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_has_text_tokens_and_stats(model_args, capsys):
    argv = ["generate", *model_args, "--max-tokens", "9", "--ignore-eos", "--json", "def add(a, b):"]
    code, out, _ = run_main(argv, capsys)
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == 9
    assert result["stats"]["steps"] >= 1 and result["stats"]["acceptance_length"] >= 1.0
    assert result["stats"]["finish_reason"] == "length"


def test_streamed_text_equals_json_text_and_stdin_prompt_works(model_args, capsys, monkeypatch):
    common = [
        "generate",
        *model_args,
        "--max-tokens",
        "12",
        "--temperature",
        "1",
        "--seed",
        "5",
        "--ignore-eos",
    ]
    code, streamed, err = run_main([*common, "--mode", "chain", "The quick brown fox"], capsys)
    assert code == 0 and "acceptance length" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("The quick brown fox"))
    code, out, _ = run_main([*common, "--mode", "chain", "--json"], capsys)
    assert code == 0
    assert streamed == json.loads(out)["text"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--budget", "0", "x"], "budget"),
        (["generate", "--temperature", "hot", "x"], "--temperature"),
        (["generate", "--top-p", "2", "x"], "top_p"),
        (["generate", "--mode", "beam", "x"], "--mode"),
        (["generate", "--device", "tpu", "x"], "device"),
        (["generate", "--threads", "0", "x"], "--threads"),
        (["generate", "--target", "/no/such/dir", "--mode", "ar", "x"], "not a model directory"),
        (["generate", "--drafter", "/d", "x"], "needs its own target"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_bad_values_exit_2_with_a_message(argv, message, capsys):
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_help_lists_the_options_and_the_serve_command():
    result = subprocess.run(
        [sys.executable, "-m", "ddtree_serve.cli", "generate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for option in (
        "--mode",
        "--budget",
        "--temperature",
        "--top-p",
        "--top-k",
        "--max-tokens",
        "--seed",
        "--json",
    ):
        assert option in result.stdout
    top = subprocess.run([sys.executable, "-m", "ddtree_serve.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0 and "serve" in top.stdout


def test_serve_arguments_come_from_the_launcher(capsys):
    code, out, _ = run_main(["serve", "--help"], capsys)
    assert code == 0
    assert "--http-port" in out
