"""Byte-level BPE tokenizer for the bundled pair, trained with `tokenizers`.

Byte-level means every byte string round-trips, so any prompt is encodable. The two special
tokens take the first ids: end-of-text separates documents (and is the EOS), the mask token
fills the drafter's block positions after the anchor.
"""

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with `vocab_size` entries, specials at ids 0 and 1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eos_token_id, mask_token_id) of a tokenizer made by `train_tokenizer`."""
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    mask_id = tokenizer.token_to_id(MASK_TOKEN)
    if eos_id is None or mask_id is None:
        raise ValueError(f"tokenizer lacks the special tokens {SPECIAL_TOKENS}")
    return eos_id, mask_id


def save_tokenizer(tokenizer: Tokenizer, model_dir: Path, max_length: int) -> None:
    """Write tokenizer.json plus the small tokenizer_config.json that HF model dirs carry."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "add_bos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
