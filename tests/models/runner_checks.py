"""Family-independent TargetRunner checks, shared by the Qwen3 and DeepseekV3 runner tests.

Each check drives a runner the way the engine does (prefill, decode, tree verify, commit) and
compares it with an uncached reference: transformers' own model, or our model run over each
full token sequence with a plain causal mask.
"""

import torch
from torch import nn

from ddtree_serve.models.layers import causal_mask
from ddtree_serve.models.qwen3 import context_features
from ddtree_serve.models.runner import TargetRunner
from tests.models.trees import path_to, random_parents, tree_inputs

TOL = 1e-4


def full_forward(runner: TargetRunner, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Uncached reference: logits `[T, V]` and features `[T, F]` of one plain causal pass."""
    ids = torch.tensor([token_ids])
    positions = torch.arange(len(token_ids))[None]
    with torch.no_grad():
        out = runner.model(
            ids, positions, causal_mask(len(token_ids)), output_layer_ids=runner.target_layer_ids
        )
    features = context_features(out, runner.target_layer_ids)
    return runner.model.logits(out.hidden)[0], features[0]


def check_prefill_and_decode_match_hf(
    runner: TargetRunner, hf_model: nn.Module, token_ids: list[int], *, num_prompt: int, slot: int
) -> None:
    """Prefill `token_ids[:num_prompt]`, decode the rest one by one; logits and features equal HF's."""
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids]), output_hidden_states=True)
    expected_logits = expected.logits[0]  # [T, V]
    # layer id i is HF hidden_states[i + 1]
    expected_features = torch.cat([expected.hidden_states[i + 1][0] for i in runner.target_layer_ids], -1)
    logits, features = runner.prefill(slot, token_ids[:num_prompt])
    assert features.shape == (num_prompt, runner.feature_dim)
    assert (logits - expected_logits[num_prompt - 1]).abs().max() < TOL
    assert (features - expected_features[:num_prompt]).abs().max() < TOL
    for t in range(num_prompt, len(token_ids)):  # decode: one token at a time on top of the cache
        logits, features = runner.prefill(slot, token_ids[t : t + 1])
        assert (logits - expected_logits[t]).abs().max() < TOL, t
        assert (features[0] - expected_features[t]).abs().max() < TOL, t
    assert runner.seq_len(slot) == len(token_ids)


def check_verify_matches_path_decoding_then_commit(runner: TargetRunner, seed: int) -> None:
    """Random trees in non-contiguous slots with different prefixes, padded to a common N.

    Every node's logits and features equal a plain pass over its root-to-node path; after
    committing the path to each tree's last node, decoding continues as if that path had been
    prefilled. Needs a runner with at least 4 slots and 40 rows per slot.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    slots = [3, 1]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 5)]
    trees = []
    for num_nodes in (12, 7):
        trees.append(
            (torch.randint(0, vocab, (num_nodes,), generator=gen).tolist(), random_parents(num_nodes, gen))
        )
    for slot, prompt in zip(slots, prompts, strict=True):
        runner.prefill(slot, prompt)
    batch = tree_inputs(trees, padded_num_nodes=14)
    starts = [runner.seq_len(s) for s in slots]
    logits, features = runner.verify(slots, batch)
    assert logits.shape == (2, 14, vocab) and features.shape == (2, 14, runner.feature_dim)

    for b, (token_ids, parents) in enumerate(trees):
        for node in range(len(token_ids)):
            path = [token_ids[i] for i in path_to(parents, node)]
            ref_logits, ref_features = full_forward(runner, prompts[b] + path)
            assert (logits[b, node] - ref_logits[-1]).abs().max() < TOL, (b, node)
            assert (features[b, node] - ref_features[-1]).abs().max() < TOL, (b, node)

    # accept the path to each tree's last node (arbitrary, non-contiguous node indices)
    accepted = [path_to(parents, len(token_ids) - 1) for token_ids, parents in trees]
    depth = max(len(p) for p in accepted)
    accept_index = torch.full((2, depth), -1, dtype=torch.int64)
    for b, path in enumerate(accepted):
        accept_index[b, : len(path)] = torch.tensor(path)
    assert runner.commit(slots, accept_index) == [starts[b] + len(accepted[b]) for b in range(2)]
    for b, slot in enumerate(slots):
        assert runner.seq_len(slot) == starts[b] + len(accepted[b])
        committed = prompts[b] + [trees[b][0][i] for i in accepted[b]]
        next_token = (7 * b + 11) % vocab
        logits_after, _ = runner.prefill(slot, [next_token])
        ref_logits, _ = full_forward(runner, [*committed, next_token])
        assert (logits_after - ref_logits[-1]).abs().max() < TOL
