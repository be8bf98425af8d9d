"""Sampling verification is lossless: emitted tokens follow the target, shown by chi-square.

One target "model" over a small vocabulary: P0 at the root and P_next[a] after token a. Many
random draft trees (or chains) are verified against it, tens of thousands of times each in one
batched call, and the counts of the first token and of the first two tokens are compared with
P0(a) and P0(a) * P_next[a](b). A step that emits a single token is followed by a second step
(a fresh tree rooted at that token) to get the second token. The draws are also tested against
a distribution with 2% of the mass moved, which must be rejected (so the test has power), and
`threshold_acc < 1` must be seen as biased.
"""

from dataclasses import dataclass

import pytest
import torch

from ddtree_serve.tree import (
    DraftTree,
    VerifyBatch,
    build_chain,
    build_ddtree,
    build_verify_batch,
    draft_topk,
)
from ddtree_serve.verify import VerifyResult, target_probs, verify_sampling

VOCAB = 6
NUM_LEVELS = 3
NUM_TREES = 64
DRAWS_PER_TREE = 1500  # 96,000 draws per test
P_PASS = 1e-4  # unbiased samplers must not be rejected at this level (fixed seeds)
P_REJECT = 1e-6  # a 2% bias must be rejected at this level


@dataclass
class TargetModel:
    root_probs: torch.Tensor  # [V] P0
    next_probs: torch.Tensor  # [V, V] P_next[a] = target after token a


def make_target(generator: torch.Generator, temperature: float, top_k: int, top_p: float) -> TargetModel:
    logits = torch.randn(1, VOCAB + 1, VOCAB, generator=generator) * 1.5
    params = (torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    probs = target_probs(logits, *params)[0]
    return TargetModel(root_probs=probs[0], next_probs=probs[1:])


def make_trees(generator: torch.Generator, kind: str) -> list[DraftTree]:
    """Random drafts: logits loosely correlated with nothing, so acceptance varies widely."""
    trees = []
    for _ in range(NUM_TREES):
        draft_logits = torch.randn(NUM_LEVELS, VOCAB, generator=generator) * 2
        if kind == "chain":
            trees.append(build_chain(draft_logits.argmax(-1), root_token=0))
        else:
            budget = int(torch.randint(1, 12, (1,), generator=generator))
            k = int(torch.randint(1, VOCAB + 1, (1,), generator=generator))
            trees.append(build_ddtree(*draft_topk(draft_logits, k), budget=budget, root_token=0))
    return trees


def node_probs(batch: VerifyBatch, target: TargetModel, generator: torch.Generator) -> torch.Tensor:
    """[B, N, V]: P0 at the root, P_next[token] at depth 1, random rows deeper."""
    batch_size, num_slots = batch.tokens.shape
    deeper = torch.softmax(torch.randn(batch_size, num_slots, VOCAB, generator=generator) * 1.5, dim=-1)
    probs = torch.where((batch.depths == 1).unsqueeze(-1), target.next_probs[batch.tokens], deeper)
    probs[:, 0] = target.root_probs
    return probs


def repeat_batch(batch: VerifyBatch, copies: int) -> VerifyBatch:
    """The batch tiled `copies` times along B (fast: no per-tree Python work)."""
    tile = lambda t: t.repeat(copies, *([1] * (t.dim() - 1)))
    batch_size, num_slots = batch.tokens.shape
    return VerifyBatch(
        tokens=tile(batch.tokens),
        depths=tile(batch.depths),
        parents=tile(batch.parents),
        retrieve_index=torch.arange(copies * batch_size * num_slots).view(-1, num_slots),
        retrieve_next_token=tile(batch.retrieve_next_token),
        retrieve_next_sibling=tile(batch.retrieve_next_sibling),
        attn_mask=tile(batch.attn_mask),
        num_nodes=tile(batch.num_nodes),
        max_depth=batch.max_depth,
    )


def emitted_at(batch: VerifyBatch, result: VerifyResult, position: int) -> torch.Tensor:
    """[B] the token emitted at `position` (0-based) where the step emitted that many, else -1."""
    node = result.accept_index[:, position + 1 : position + 2].clamp(min=0)
    drafted = batch.tokens.gather(1, node).view(-1)
    emitted = torch.where(result.accept_len > position, drafted, result.bonus_token)
    return torch.where(result.accept_len >= position, emitted, -1)


def sample_two_tokens(
    kind: str, target: TargetModel, seed: int, threshold_acc: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run step 1 (and step 2 where step 1 emitted one token); returns (first, second) [M]."""
    generator = torch.Generator().manual_seed(seed)
    step1 = build_verify_batch(make_trees(generator, kind))
    step2 = build_verify_batch(make_trees(generator, kind))
    probs1 = node_probs(step1, target, generator).repeat(DRAWS_PER_TREE, 1, 1)
    step1 = repeat_batch(step1, DRAWS_PER_TREE)
    num_draws = step1.batch_size
    coins = torch.rand(num_draws, step1.padded_num_nodes, generator=generator)
    result1 = verify_sampling(
        step1, probs1, coins, torch.rand(num_draws, generator=generator), 1.0, threshold_acc
    )
    first = emitted_at(step1, result1, 0)

    # Step 2 is rooted at `first`: its root row is P_next[first].
    probs2 = node_probs(step2, target, generator).repeat(DRAWS_PER_TREE, 1, 1)
    probs2[:, 0] = target.next_probs[first]
    step2 = repeat_batch(step2, DRAWS_PER_TREE)
    coins2 = torch.rand(num_draws, step2.padded_num_nodes, generator=generator)
    result2 = verify_sampling(
        step2, probs2, coins2, torch.rand(num_draws, generator=generator), 1.0, threshold_acc
    )
    second_in_step2 = emitted_at(step2, result2, 0)
    second = torch.where(result1.accept_len >= 1, emitted_at(step1, result1, 1), second_in_step2)
    return first, second


def chi_square_pvalue(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 draws are pooled into one."""
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * samples.numel()
    small = expected < 5
    assert counts[expected == 0].sum() == 0, "a token of target probability 0 was emitted"
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def shift_two_percent(probs: torch.Tensor) -> torch.Tensor:
    """Move 0.02 of probability from the most likely cell to the second most likely one."""
    shifted = probs.clone().double()
    top2 = torch.topk(shifted, 2).indices
    shifted[top2[0]] -= 0.02
    shifted[top2[1]] += 0.02
    return shifted


CASES = [  # (kind, temperature, top_k, top_p, seed)
    ("tree", 1.0, 0, 1.0, 11),
    ("tree", 0.6, 0, 1.0, 12),
    ("tree", 1.7, 0, 1.0, 13),
    ("tree", 1.0, 4, 0.85, 14),  # top-k / top-p leave tokens of probability 0 in the tree
    ("chain", 1.0, 0, 1.0, 15),
    ("chain", 0.6, 0, 1.0, 16),
    ("chain", 1.7, 3, 1.0, 17),
]


@pytest.mark.parametrize(("kind", "temperature", "top_k", "top_p", "seed"), CASES)
def test_emitted_tokens_follow_the_target(
    kind: str, temperature: float, top_k: int, top_p: float, seed: int
) -> None:
    target = make_target(torch.Generator().manual_seed(seed), temperature, top_k, top_p)
    first, second = sample_two_tokens(kind, target, seed + 1)

    first_probs = target.root_probs
    joint_probs = (target.root_probs.view(-1, 1) * target.next_probs).reshape(-1)  # [V * V]
    joint = first * VOCAB + second
    assert chi_square_pvalue(first, first_probs) > P_PASS
    assert chi_square_pvalue(joint, joint_probs) > P_PASS
    # Power: the same draws reject a target with 2% of its mass moved.
    assert chi_square_pvalue(first, shift_two_percent(first_probs)) < P_REJECT
    assert chi_square_pvalue(joint, shift_two_percent(joint_probs)) < P_REJECT


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_threshold_acc_below_one_is_detected_as_biased(kind: str) -> None:
    target = make_target(torch.Generator().manual_seed(7), 1.0, 0, 1.0)
    first, second = sample_two_tokens(kind, target, 8, threshold_acc=0.7)
    joint_probs = (target.root_probs.view(-1, 1) * target.next_probs).reshape(-1)
    assert chi_square_pvalue(first * VOCAB + second, joint_probs) < P_REJECT
