"""Shared fixtures: a random-weight tiny target + DFlash drafter pair in the on-disk layout.

`tiny_target_dir` is a Qwen3 directory (config.json, model.safetensors, tokenizer.json with
`<|endoftext|>` = eos and `<|MASK|>` = the drafter's mask token); `tiny_drafter_dir` is a
z-lab-style DFlash directory conditioned on target layers 1 and 2 (block size 8). Any test
in the repository can request them; they are written once per session.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ddtree_serve.models.random_weights import write_random_drafter_dir, write_random_target_dir

# The models under test are tiny: on small shared CI machines several intra-op threads make their
# matmuls 10-100x slower through contention, so the whole suite runs single-threaded.
torch.set_num_threads(1)

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
_TOKENIZER_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\nprint(sys.argv)\n",
    "for i in range(10):\n    total += i * i\n",
]


@dataclass(frozen=True)
class TinyModelDirs:
    target: Path
    drafter: Path
    eos_token_id: int
    mask_token_id: int
    vocab_size: int


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE of ~300 tokens trained on a few strings, with eos and mask tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_TEXTS, trainer=trainer)
    return tokenizer


def tiny_target_config(vocab_size: int, eos_token_id: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def tiny_drafter_config(target_config: dict, mask_token_id: int) -> dict:
    return {
        **target_config,
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
        "block_size": 8,
        "num_target_layers": target_config["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": [1, 2]},
    }


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> TinyModelDirs:
    root = tmp_path_factory.mktemp("tiny_models")
    tokenizer = tiny_tokenizer()
    eos_id, mask_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(MASK_TOKEN)
    target_config = tiny_target_config(tokenizer.get_vocab_size(), eos_id)
    target = write_random_target_dir(root / "target", target_config, seed=0, tokenizer=tokenizer)
    drafter = write_random_drafter_dir(root / "drafter", tiny_drafter_config(target_config, mask_id), seed=1)
    return TinyModelDirs(target, drafter, eos_id, mask_id, tokenizer.get_vocab_size())


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_model_dirs: TinyModelDirs) -> Path:
    return tiny_model_dirs.target


@pytest.fixture(scope="session")
def tiny_drafter_dir(tiny_model_dirs: TinyModelDirs) -> Path:
    return tiny_model_dirs.drafter


_session_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _session_exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Ends the process with pytest's status once every report is written, skipping teardown.

    The serve tests start and stop Ray several times in this one process, and Ray does not
    support that with its background threads alive (ray-project/ray#31145): now and then, after
    every test has passed and the summary is printed, the interpreter's own teardown segfaults
    inside Ray's or gRPC's native threads (exit 139 in CI). Nothing of the code under test runs
    at that point, so the process leaves with the status pytest decided on.
    """
    if not _session_exit_status:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session_exit_status[-1])
