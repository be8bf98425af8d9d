"""One fixed engine-like scenario for a TargetRunner, and the entry point of a tensor-parallel rank.

`drive_runner` runs prefill, two rounds of tree verify + commit and a decode step on a runner and
returns every logit and feature it saw, so a TP=1 runner and each rank of a TP=N group can be
compared. `rank_main` is what `torch.multiprocessing` starts in each rank's process (kept in a
module with light imports: every spawned process imports it).
"""

from pathlib import Path

import torch
import torch.distributed

from ddtree_serve.models.families import MLACache
from ddtree_serve.models.parallel import RankSpec, join_group
from ddtree_serve.models.runner import TargetRunner
from tests.models.trees import path_to, random_parents, tree_inputs

SLOTS = [3, 1]
LAYER_IDS = (0, 2)


Tree = tuple[list[int], list[int]]  # (token ids, parents), as `tree_inputs` takes it
Case = tuple[Path, MLACache]  # a model directory and the MLA cache to run it over


def case_name(case: Case) -> str:
    return f"{case[0].name}/{case[1]}"


def _random_trees(vocab: int, sizes: tuple[int, ...], gen: torch.Generator) -> list[Tree]:
    return [(torch.randint(0, vocab, (n,), generator=gen).tolist(), random_parents(n, gen)) for n in sizes]


def _commit_paths(runner: TargetRunner, trees: list[Tree], nodes: list[int]) -> list[int]:
    """Commit, per tree, the path from the root to `nodes[b]` (non-contiguous node indices)."""
    paths = [path_to(parents, node) for (_, parents), node in zip(trees, nodes, strict=True)]
    accept_index = torch.full((len(paths), max(len(p) for p in paths)), -1, dtype=torch.int64)
    for b, path in enumerate(paths):
        accept_index[b, : len(path)] = torch.tensor(path)
    return runner.commit(SLOTS, accept_index)


def drive_runner(runner: TargetRunner, seed: int = 0) -> dict[str, torch.Tensor]:
    """Prefill two slots, verify + commit two rounds of random trees, decode one token each."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    results: dict[str, torch.Tensor] = {}
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 5)]
    logits, features = runner.prefill_batch(SLOTS, prompts)
    results["prefill_logits"], results["prefill_features"] = logits, torch.cat(features)
    for round_index, (sizes, padded, accepted) in enumerate((((12, 7), 14, None), ((9, 10), 10, [4, 9]))):
        trees = _random_trees(vocab, sizes, gen)
        logits, features = runner.verify(SLOTS, tree_inputs(trees, padded_num_nodes=padded))
        results[f"verify{round_index}_logits"] = logits.clone()
        results[f"verify{round_index}_features"] = features.clone()
        nodes = accepted or [len(tokens) - 1 for tokens, _ in trees]
        results[f"commit{round_index}_lengths"] = torch.tensor(_commit_paths(runner, trees, nodes))
    logits, _ = runner.prefill_batch(SLOTS, [[7], [11 % vocab]])
    results["decode_logits"] = logits
    return results


def shard_summary(runner: TargetRunner) -> dict[str, int]:
    """What this rank holds: parameter count, embedding rows, cache heads (and whether the cache entry
    is replicated, as MLA's latent), routed experts of the first MoE layer."""
    model = runner.model
    summary = {
        "num_values": sum(t.numel() for t in model.state_dict().values()),
        "embed_rows": model.model.embed_tokens.weight.shape[0],
        "cached_heads": runner.cache.keys.shape[3],
        "cache_replicated": int(runner.kv_layout.replicated),
    }
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            is_dense = isinstance(experts, torch.nn.ModuleList)
            summary["local_experts"] = len(experts) if is_dense else experts.num_experts
            break
    return summary


def build_runner(case: Case, tensor_parallel: object = None) -> TargetRunner:
    model_dir, mla_cache = case
    return TargetRunner.from_pretrained(
        model_dir,
        num_slots=4,
        max_seq_len=64,
        target_layer_ids=LAYER_IDS,
        tensor_parallel=tensor_parallel,
        mla_cache=mla_cache,
    )


def rank_main(rank: int, world_size: int, init_method: str, cases: list[Case], out_dir: Path) -> None:
    """One rank: join the gloo group, run the scenario on every case, save what it saw."""
    torch.set_num_threads(1)
    tp = join_group(RankSpec(rank, world_size, init_method, timeout_s=120.0), "cpu")
    saved = {}
    for case in cases:
        runner = build_runner(case, tp)
        saved[case_name(case)] = {"results": drive_runner(runner), "summary": shard_summary(runner)}
    torch.save(saved, out_dir / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()
