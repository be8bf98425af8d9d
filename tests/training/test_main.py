"""`python -m ddtree_serve.training` refuses what would fail a run minutes in, before it starts."""

from pathlib import Path

import pytest

from ddtree_serve.training.__main__ import parse_args


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "tpu"], "not a torch device"),
        (["--drafter-lr", "-1"], "--drafter-lr: must be a finite number > 0"),
        (["--target-budget-s", "nan"], "--target-budget-s: must be a finite number > 0"),
        (["--drafter-budget-s", "0"], "--drafter-budget-s: must be a finite number > 0"),
        (["--generated-seqs", "0"], "--generated-seqs: must be >= 1"),
        (["--tokenizer", "/no/tokenizer.json"], "--tokenizer /no/tokenizer.json: no such file"),
        (["--target-from", "/no/target"], "not a model directory"),
        (["--drafter-from", "/no/drafter"], "not a model directory"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--smoke", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err, err
    assert "Traceback" not in err


def test_an_output_path_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "pair"
    taken.write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--out", str(taken)])
    assert "exists and is not a directory" in capsys.readouterr().err


def test_good_arguments_parse(tmp_path: Path) -> None:
    args = parse_args(["--smoke", "--out", str(tmp_path / "pair"), "--device", "cpu", "--drafter-lr", "3e-4"])
    assert args.drafter_lr == 3e-4 and args.out == tmp_path / "pair"
