"""`VerifyResult`: what verification decided for each request of a batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_serve.tree import VerifyBatch


@dataclass(frozen=True)
class VerifyResult:
    """Accepted path and bonus token per request, on the device verification ran on."""

    accept_index: torch.Tensor  # [B, max_depth + 1] int64 local node indices, root first, -1 padded
    accept_len: torch.Tensor  # [B] int64 accepted draft nodes (root excluded)
    bonus_token: torch.Tensor  # [B] int64 token sampled at the last accepted node

    def emitted_tokens(self, batch: VerifyBatch) -> list[list[int]]:
        """Per request: the accepted draft tokens, then the bonus (1 to max_depth + 1 tokens)."""
        path_tokens = batch.tokens.to(self.accept_index.device).gather(1, self.accept_index.clamp(min=0))
        path_rows = path_tokens.cpu().tolist()
        lengths = self.accept_len.cpu().tolist()
        bonuses = self.bonus_token.cpu().tolist()
        return [[*row[1 : 1 + n], bonus] for row, n, bonus in zip(path_rows, lengths, bonuses, strict=True)]
