"""Token streams for training: documents joined by end-of-text, sampled as random windows.

The whole corpus is a few million tokens, so it lives on the training device as one int64
tensor and a batch is a gather of random windows: no loader, no workers, no host round trip.
"""

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from ddtree_serve.training.corpus import SourceFile


def encode_stream(tokenizer: Tokenizer, docs: Sequence[SourceFile], eos_token_id: int) -> torch.Tensor:
    """All documents as one 1-D int64 tensor, each document followed by end-of-text."""
    encodings = tokenizer.encode_batch([doc.text for doc in docs])
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def sample_windows(
    stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """`[batch_size, seq_len]` windows of `stream` at uniformly random offsets."""
    if stream.numel() < seq_len:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than seq_len={seq_len}")
    starts = torch.randint(
        0, stream.numel() - seq_len + 1, (batch_size,), generator=generator, device=generator.device
    )
    offsets = torch.arange(seq_len, device=stream.device)
    return stream[starts.to(stream.device)[:, None] + offsets[None, :]]


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping `[n, seq_len]` windows covering `stream` from its start (tail dropped)."""
    num_windows = stream.numel() // seq_len
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    if num_windows == 0:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than seq_len={seq_len}")
    return stream[: num_windows * seq_len].view(num_windows, seq_len)
