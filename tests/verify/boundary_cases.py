"""Hand-built verification cases on the boundaries where the old and the new kernel rules differ.

The rule (design, "Verification semantics"; SGLang after issue #35771) accepts a child when
`q > 0 and (coin < acc / max(threshold_acc, 1e-9) or q >= threshold_single)`; the old rule
accepted when `coin <= acc / threshold_acc or q >= threshold_single`. Every probability here is
a power of two, so the float32 sums are exact and the coins sit exactly on them. Each case names
the accepted path under both rules (tests/verify/test_sgl_adapter.py runs a kernel with the old
rule to show that they do differ) and the bonus, whose inverse CDF is half-open too.

         0 (root, token 0)
       /    |    \
    1:2    2:3    3:4      root's children in descending logw order
     |
    4:5
"""

from dataclasses import dataclass

import numpy as np
import torch

from ddtree_serve.tree import DraftTree, VerifyBatch, build_verify_batch

TREE = DraftTree(
    token_ids=np.array([0, 2, 3, 4, 5]),
    depths=np.array([0, 1, 1, 1, 2]),
    parents=np.array([-1, 0, 0, 0, 1]),
    logws=np.array([0.0, -0.5, -1.0, -2.0, -1.5]),
)
# Root row: children 2 (0.25), 3 (0.5), 4 (0.0): cumulative 0.25, 0.75, 0.75.
ROOT_PROBS = (0.125, 0.125, 0.25, 0.5, 0.0, 0.0)
NODE_PROBS = (
    (0.25, 0.25, 0.0, 0.0, 0.0, 0.5),  # node 1: child 5 (0.5)
    (0.25, 0.0, 0.25, 0.5, 0.0, 0.0),  # node 2, a leaf: token 1 is a zero-mass bucket
    (1.0, 0.0, 0.0, 0.0, 0.0, 0.0),  # node 3, a leaf
    (0.0, 0.0, 0.0, 0.0, 0.5, 0.5),  # node 4, a leaf
)
ZERO_FIRST_CHILD = (0.375, 0.125, 0.0, 0.5, 0.0, 0.0)  # root's first child has q = 0
ZERO_CHILDREN = (0.5, 0.5, 0.0, 0.0, 0.0, 0.0)  # every root child has q = 0
TINY_FIRST_CHILD = (0.25, 0.25, 2.0**-40, 0.5, 0.0, 0.0)  # q = 2^-40: 9e-4 after dividing by 1e-9
JUST_BELOW_QUARTER = float(np.nextafter(np.float32(0.25), np.float32(0.0)))


@dataclass(frozen=True)
class BoundaryCase:
    name: str
    coins: tuple[float, float]  # the root's coin, node 1's coin (the only inner nodes)
    coin_final: float
    accept_index: list[int]  # under the rule
    bonus_token: int  # under the rule
    inclusive_accept_index: list[int]  # under the old `<=` rule without the q > 0 guard
    threshold_single: float = 1.0
    threshold_acc: float = 1.0
    root_probs: tuple[float, ...] = ROOT_PROBS


def boundary_inputs(
    cases: list[BoundaryCase], device: str = "cpu"
) -> tuple[VerifyBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request per case: (batch, target_probs [B, 5, 6], coins [B, 5], coin_final [B])."""
    probs = torch.tensor([[case.root_probs, *NODE_PROBS] for case in cases], dtype=torch.float32)
    coins = torch.tensor([[*case.coins, 0.0, 0.0, 0.0] for case in cases], dtype=torch.float32)
    coin_final = torch.tensor([case.coin_final for case in cases], dtype=torch.float32)
    batch = build_verify_batch([TREE] * len(cases))
    return batch.to(device), probs.to(device), coins.to(device), coin_final.to(device)


CASES = [
    # Coin 0.25 = the first child's cumulative: not in [0, 0.25), so the second child is taken
    # (0.25 < 0.75). Node 2 is a leaf; coin_final 0 draws its first positive token.
    BoundaryCase("coin-on-first-cumulative", (0.25, 0.75), 0.0, [0, 2, -1], 0, [0, 1, -1]),
    # Coin 0.75 = the second child's cumulative, the third child has q = 0: nothing accepted.
    # Root residual: tokens 0 and 1 of 0.125; u = 0.5 * 0.25 = 0.125 is token 0's upper end.
    BoundaryCase("coin-on-last-cumulative", (0.75, 0.75), 0.5, [0, -1, -1], 1, [0, 2, -1]),
    # Node 1 accepted, then its coin 0.5 = its child's q: rejected. Node 1 residual: tokens 0, 1
    # of 0.25; u = 0.5 * 0.5 = 0.25 is token 0's upper end.
    BoundaryCase("coin-on-deeper-cumulative", (0.125, 0.5), 0.5, [0, 1, -1], 1, [0, 1, 4]),
    # Coin 0 and a first child of q = 0: `0 <= 0` took it; now the second child is taken.
    # Node 2's row has a zero-mass token 1: u = 0.25 on cdf 0.25, 0.25, 0.5 skips it to token 2.
    BoundaryCase(
        "coin-zero-zero-probability-child",
        (0.0, 0.75),
        0.25,
        [0, 2, -1],
        2,
        [0, 1, -1],
        root_probs=ZERO_FIRST_CHILD,
    ),
    # Coin 0 and every child at q = 0: nothing accepted; u = 0.5 on the residual 0.5, 0.5.
    BoundaryCase(
        "coin-zero-all-children-zero", (0.0, 0.75), 0.5, [0, -1, -1], 1, [0, 1, -1], root_probs=ZERO_CHILDREN
    ),
    # threshold_acc 0 is clamped to 1e-9: 2^-40 / 1e-9 = 9e-4 < coin 0.5 rejects the first child
    # (unclamped, 2^-40 / 0 = inf accepted it, then node 4); the second child's 0.5 / 1e-9 accepts.
    BoundaryCase(
        "threshold-acc-zero",
        (0.5, 0.75),
        0.5,
        [0, 2, -1],
        3,
        [0, 1, 4],
        threshold_acc=0.0,
        root_probs=TINY_FIRST_CHILD,
    ),
    # threshold_acc 1e-12 is clamped too: unclamped, 2^-40 / 1e-12 = 0.91 >= 0.5 accepted.
    BoundaryCase(
        "threshold-acc-below-clamp",
        (0.5, 0.75),
        0.5,
        [0, 2, -1],
        3,
        [0, 1, 4],
        threshold_acc=1e-12,
        root_probs=TINY_FIRST_CHILD,
    ),
    # `q >= threshold_single` stays inclusive: q = 0.5 of the second child meets 0.5.
    BoundaryCase(
        "threshold-single-inclusive", (0.9, 0.75), 0.0, [0, 2, -1], 0, [0, 2, -1], threshold_single=0.5
    ),
    # threshold_single 0 still never accepts q = 0 (`0 >= 0` took the first child and its child).
    BoundaryCase(
        "threshold-single-zero",
        (0.9, 0.75),
        0.25,
        [0, 2, -1],
        2,
        [0, 1, 4],
        threshold_single=0.0,
        root_probs=ZERO_FIRST_CHILD,
    ),
    # A coin one float below the boundary accepts under both rules; coin 0 then takes node 4.
    # Node 4's residual is 0.5, 0.5 on tokens 4, 5; u = 0.5 is token 4's upper end.
    BoundaryCase("coin-just-below-cumulative", (JUST_BELOW_QUARTER, 0.0), 0.5, [0, 1, 4], 5, [0, 1, 4]),
]
