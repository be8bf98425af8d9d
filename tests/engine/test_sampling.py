"""Seeded sampling is reproducible, and tree verification samples from the target's distribution."""

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import TargetRunner, bundled_target_dir, load_tokenizer
from ddtree_serve.verify import target_probs
from tests.engine.conftest import bundled_pair_present, run_to_completion

NUM_SAMPLES = 300  # ddtree samples; test_chi_square_has_power_against_eager_acceptance sizes it
NUM_TOKENS = 3


def sample_prefixes(engine: SpecEngine, prompt: list[int], seeds: range, params: SamplingParams) -> Counter:
    for seed in seeds:
        engine.add_request(str(seed), prompt, dataclasses.replace(params, seed=seed))
    return Counter(tuple(tokens) for tokens in run_to_completion(engine).values())


def exact_prefix_distribution(
    target_dir: Path, prompt: list[int], params: SamplingParams, num_tokens: int
) -> dict[tuple[int, ...], float]:
    """P(first `num_tokens` tokens) under the target with `params`' temperature and top-k/top-p.

    This is what plain decoding samples from (its step is a root-only tree whose bonus is drawn
    from these probabilities), computed exactly by enumerating the support prefix by prefix.
    """
    support_size = params.top_k ** (num_tokens - 1)
    runner = TargetRunner.from_pretrained(target_dir, num_slots=1, max_seq_len=len(prompt) + num_tokens + 1)
    knobs = (
        torch.tensor([params.temperature]),
        torch.tensor([params.top_k]),
        torch.tensor([params.top_p]),
    )
    distribution: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(num_tokens):
        extended: dict[tuple[int, ...], float] = {}
        for prefix, prefix_prob in distribution.items():
            runner.release(0)
            logits, _ = runner.prefill(0, [*prompt, *prefix])
            probs = target_probs(logits.view(1, 1, -1), *knobs)[0, 0]  # [V]
            for token in torch.nonzero(probs).view(-1).tolist():
                extended[(*prefix, token)] = prefix_prob * float(probs[token])
        distribution = extended
    assert len(distribution) <= support_size * params.top_k
    return distribution


def chi_square(counts: Counter, expected_probs: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Goodness-of-fit statistic and degrees of freedom; categories expected < 5 are pooled."""
    n = sum(counts.values())
    assert set(counts) <= set(expected_probs), "a sample fell outside the target's support"
    observed: Counter = Counter()
    expected: Counter = Counter()
    for key, prob in expected_probs.items():
        bucket = key if prob * n >= min_expected else "pooled"
        observed[bucket] += counts[key]
        expected[bucket] += prob * n
    statistic = sum((observed[k] - expected[k]) ** 2 / expected[k] for k in expected)
    return statistic, len(expected) - 1


def chi_square_pvalue(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


@dataclass(frozen=True)
class SamplingSetup:
    """The DDTree engine to test, the target it must match, the prompt and the sampling params."""

    make_tree_engine: Callable[[], tuple[SpecEngine, Callable[[], int]]]  # engine, verify-step counter
    target_dir: Path
    prompt: list[int]
    params: SamplingParams


@pytest.fixture(scope="module")
def sampling_setup(make_oracle_engine, pair_dirs, prompt_ids) -> SamplingSetup:
    """The bundled pair with its own drafter when present; else the tiny target + oracle drafter.

    The random tiny target is nearly uniform, so its test keeps top_k = 2 to leave the oracle's
    greedy proposals enough probability to be accepted.
    """
    if bundled_pair_present():

        def make_tree() -> tuple[SpecEngine, Callable[[], int]]:
            engine = build_local_engine(
                EngineConfig(mode="ddtree", budget=16, max_num_seqs=32, record_timings=True)
            )
            return engine, lambda: engine.timer.counts["verify"]

        return SamplingSetup(
            make_tree_engine=make_tree,
            target_dir=bundled_target_dir(),
            prompt=load_tokenizer(bundled_target_dir()).encode("def fibonacci(n):").ids,
            params=SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=4, ignore_eos=True),
        )

    def make_oracle_tree() -> tuple[SpecEngine, Callable[[], int]]:
        engine, target = make_oracle_engine("ddtree", budget=8, max_num_seqs=32)
        return engine, lambda: len(target.verify_batch_sizes)

    return SamplingSetup(
        make_tree_engine=make_oracle_tree,
        target_dir=pair_dirs[0],
        prompt=prompt_ids[0],
        params=SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=2, ignore_eos=True),
    )


def test_fixed_seed_reproduces_and_seeds_differ(make_oracle_engine, prompt_ids):
    def run(seeds: list[int]) -> list[list[int]]:
        engine, _ = make_oracle_engine("ddtree", budget=8, max_num_seqs=4)
        for i, seed in enumerate(seeds):
            params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
            engine.add_request(str(i), prompt_ids[i % len(prompt_ids)], params)
        outputs = run_to_completion(engine)
        return [outputs[str(i)] for i in range(len(seeds))]

    first, again = run([1, 2, 3]), run([1, 2, 3])
    assert first == again
    assert run([4, 5, 6]) != first


def test_ddtree_first_tokens_follow_the_target_distribution(sampling_setup: SamplingSetup):
    """Chi-square goodness of fit of ddtree's first sampled tokens to what plain decoding samples.

    The drafter's proposals are often what the target samples, so trees accept deep paths and
    siblings; a verification that accepted drafts too eagerly would over-represent them.
    """
    setup = sampling_setup
    tree_engine, count_verify_steps = setup.make_tree_engine()
    tree_counts = sample_prefixes(tree_engine, setup.prompt, range(NUM_SAMPLES), setup.params)
    exact = exact_prefix_distribution(setup.target_dir, setup.prompt, setup.params, NUM_TOKENS)
    # The trees did real work: more than one token per verify step on average (32 per batch).
    steps_per_batch = count_verify_steps() / -(-NUM_SAMPLES // 32)
    assert (NUM_TOKENS - 1) / steps_per_batch > 1.1
    statistic, dof = chi_square(tree_counts, exact)
    assert chi_square_pvalue(statistic, dof) > 1e-3


def test_chi_square_has_power_against_eager_acceptance(sampling_setup: SamplingSetup):
    """At NUM_SAMPLES draws the test above rejects a verifier biased toward the drafted path.

    The alternative moves 25% of the mass onto the greedy prefix (what a drafter proposes first),
    the footprint of a verifier that accepts drafts too eagerly. Computed exactly: the expected
    statistic under the alternative is dof + n * sum((p_alt - p)^2 / p) (noncentral chi-square
    mean), and it must sit far above the rejection threshold.
    """
    setup = sampling_setup
    exact = exact_prefix_distribution(setup.target_dir, setup.prompt, setup.params, NUM_TOKENS)
    greedy_prefix = max(exact, key=lambda k: exact[k])
    eager = {k: 0.75 * p + (0.25 if k == greedy_prefix else 0.0) for k, p in exact.items()}
    noncentrality, dof = chi_square(Counter({k: NUM_SAMPLES * p for k, p in eager.items()}), exact)
    assert chi_square_pvalue(noncentrality + dof, dof) < 1e-6
