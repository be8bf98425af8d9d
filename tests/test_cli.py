"""`ddtree-serve` CLI: generate (streamed text or JSON), stdin prompts, help, bad values."""

import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

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
        (["generate", "--threads", "100000", "x"], "--threads must be in [1, "),
        (["generate", "--seed", str(2**64), "x"], "seed must be in [0, 2**64)"),
        (["generate", "--cost-curve", "c.json", "x"], "pass --budget-policy adaptive"),
        (["generate", "--budget-policy", "adaptive", "--cost-curve", "/no/c.json", "x"],
         "--cost-curve /no/c.json: /no/c.json: No such file"),
        (["generate", "caf\udce9"], "the prompt is not UTF-8 text"),
        (["generate", "--target", "/no/such/dir", "--mode", "ar", "x"], "not a model directory"),
        (["generate", "--drafter", "/d", "x"], "needs its own target"),
        (["generate", "--max-model-len", "4096", "x"], "max_seq_len 4096 is longer than the target's"),
        (["generate", "--max-seq-len", "16", "x"], "max_seq_len 16 leaves no room for a prompt"),
        (["nonsense"], "invalid choice"),
    ],
)  # fmt: skip
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


def copied_pair(tiny_target_dir: Path, tiny_drafter_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    shutil.copytree(tiny_target_dir, target)
    shutil.copytree(tiny_drafter_dir, drafter)
    return target, drafter


def edit_config(model_dir: Path, change: Callable[[dict], object]) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    change(config)
    (model_dir / "config.json").write_text(json.dumps(config))


def truncate_weights(target: Path, drafter: Path) -> None:
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


DAMAGES: dict[str, Callable[[Path, Path], object]] = {
    "truncated weights": truncate_weights,
    "garbage tokenizer": lambda target, drafter: (target / "tokenizer.json").write_text("not json"),
    "config without hidden_size": lambda target, drafter: edit_config(target, lambda c: c.pop("hidden_size")),
    "drafter on layers the target lacks": lambda target, drafter: edit_config(  # the tiny target has 4
        drafter, lambda c: c["dflash_config"].update(target_layer_ids=[1, 9])
    ),
    "drafter block size 0": lambda target, drafter: edit_config(drafter, lambda c: c.update(block_size=0)),
}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncated weights", "Error while deserializing header"),
        ("garbage tokenizer", "at line 1 column"),
        ("config without hidden_size", "KeyError: 'hidden_size'"),
        ("drafter on layers the target lacks", "layers [9] do not exist"),
        ("drafter block size 0", "block_size must be >= 2"),
    ],
)
def test_model_files_that_do_not_load_exit_2_with_one_line(
    damage: str, message: str, tiny_target_dir: Path, tiny_drafter_dir: Path, tmp_path: Path, capsys
) -> None:
    target, drafter = copied_pair(tiny_target_dir, tiny_drafter_dir, tmp_path)
    DAMAGES[damage](target, drafter)
    argv = ["generate", "--target", str(target), "--drafter", str(drafter), "--max-tokens", "2", "x"]
    code, _, err = run_main(argv, capsys)
    assert code == 2 and "error: the models did not load" in err and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_reader_that_stops_early_ends_the_stream_quietly(model_args: list[str]) -> None:
    # Long enough that the writes go on after the reader has gone (the first token comes first).
    argv = [sys.executable, "-m", "ddtree_serve.cli", "generate", *model_args, "--max-tokens", "600"]
    process = subprocess.Popen(
        [*argv, "--ignore-eos", "def add(a, b):"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.read(1)
    process.stdout.close()  # as `| head -c1` does
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
