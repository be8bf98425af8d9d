"""Drafts for builder tests (hypothesis batches of top-K log-probs rich in exact ties) and the
`VerifyBatch` fields two builds are compared on."""

import torch
from hypothesis import strategies as st

from ddtree_serve.tree import draft_topk

VERIFY_FIELDS = (
    "tokens",
    "depths",
    "parents",
    "retrieve_index",
    "retrieve_next_token",
    "retrieve_next_sibling",
    "attn_mask",
    "num_nodes",
)

# Dyadic probabilities: exact ties between paths of different lengths ((1/2)^2 = 1/4).
DYADIC = [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]


@st.composite
def draft_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """(logp [B, L, K] descending per row, ids [B, L, K], budgets [B], budget_max).

    Rows come from drafter-like logits (float32 `draft_topk`, normalised over a vocabulary a
    little wider than K): small integers (many repeated log-probs), spreads of hundreds (exact
    0.0 log-probs and very negative finite ones), or random floats; or from dyadic
    probabilities in float64 (ties between paths of different depths).
    """
    batch_size = draw(st.integers(1, 4))
    num_positions = draw(st.integers(1, 5))
    num_ranks = draw(st.integers(1, 4))
    vocab_size = num_ranks + draw(st.integers(0, 2))
    mode = draw(st.sampled_from(["ties", "extreme", "floats", "dyadic"]))
    shape = (batch_size, num_positions, vocab_size)
    count = batch_size * num_positions * vocab_size
    if mode == "dyadic":
        probs = draw(st.lists(st.sampled_from(DYADIC), min_size=count, max_size=count))
        logp = torch.tensor(probs, dtype=torch.float64).view(shape).sort(dim=-1, descending=True).values
        logp = logp[..., :num_ranks].log()
        perm = draw(st.permutations(list(range(count))))
        ids = torch.tensor(perm).view(shape)[..., :num_ranks]
    else:
        if mode == "floats":
            values = st.floats(-3.0, 3.0, allow_nan=False, width=32)
        else:
            values = st.integers(0, 2).map(float if mode == "ties" else lambda v: 300.0 * v)
        logits = torch.tensor(draw(st.lists(values, min_size=count, max_size=count))).view(shape)
        logp, ids = draft_topk(logits, num_ranks)
    budget_max = draw(st.integers(0, 30))
    budgets = draw(st.lists(st.integers(0, budget_max), min_size=batch_size, max_size=batch_size))
    return logp, ids, budgets, budget_max
