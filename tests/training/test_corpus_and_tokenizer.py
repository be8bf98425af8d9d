"""The corpus split and the tokenizer's special tokens."""

from pathlib import Path

import torch

from ddtree_serve.training.corpus import HELDOUT_PER_MILLE, is_heldout, list_source_paths
from ddtree_serve.training.data import eval_windows, sample_windows
from ddtree_serve.training.tokenizer import EOS_TOKEN, MASK_TOKEN, special_token_ids, train_tokenizer


def test_corpus_is_sorted_python_without_test_or_idle_folders() -> None:
    paths = list_source_paths()
    assert paths == sorted(paths)
    assert len(paths) > 300
    assert all(path.endswith(".py") for path in paths)
    excluded = {"test", "tests", "idlelib", "site-packages"}
    assert not any(excluded & set(Path(path).parts[:-1]) for path in paths)


def test_heldout_split_is_by_file_hash_and_about_three_percent() -> None:
    paths = list_source_paths()
    heldout = [path for path in paths if is_heldout(path)]
    assert 0.01 < len(heldout) / len(paths) < 0.06
    assert is_heldout(heldout[0]) and HELDOUT_PER_MILLE == 30  # a pure function of the path


def test_tokenizer_round_trips_bytes_and_reserves_special_ids(tmp_path: Path) -> None:
    texts = ["def add(a, b):\n    return a + b\n"] * 20 + ["caf\u00e9 \u2192 \U0001f600\n"]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    assert special_token_ids(tokenizer) == (0, 1)
    text = "x = '\u00fcnicode' \U0001f600\n\tpass"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.encode(f"a{MASK_TOKEN}b{EOS_TOKEN}").ids.count(1) == 1


def test_windows_come_from_the_stream() -> None:
    stream = torch.arange(100)
    windows = sample_windows(stream, 8, 10, torch.Generator().manual_seed(0))
    assert torch.equal(windows - windows[:, :1], torch.arange(10).expand(8, 10))
    assert torch.equal(eval_windows(stream, 30), stream[:90].view(3, 30))
