"""The builder fits a slot's length to the target's context length before any weight loads."""

import logging
from pathlib import Path

import pytest

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine import builder
from ddtree_serve.engine.builder import TargetRankFactory, fitted_max_seq_len
from ddtree_serve.engine.llm import LLM
from ddtree_serve.models.context_length import target_context_length
from ddtree_serve.models.parallel import RankSpec


def test_default_length_is_capped_at_the_targets(
    tiny_target_dir: Path, tiny_drafter_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limit = target_context_length(tiny_target_dir)
    assert EngineConfig().max_seq_len > limit  # the tiny target's window is shorter than the default
    with caplog.at_level(logging.INFO, logger="ddtree_serve.engine.builder"):
        llm = LLM(str(tiny_target_dir), str(tiny_drafter_dir))
    assert llm.engine.max_seq_len == limit
    assert f"capped to the target's context length {limit}" in caplog.text
    # the drafter's cache holds the same positions as the target's
    assert llm.engine.drafter.drafter.cache.max_seq_len == limit


def test_explicit_length_is_taken_up_to_the_targets(tiny_target_dir: Path, tiny_drafter_dir: Path) -> None:
    limit = target_context_length(tiny_target_dir)
    fits = EngineConfig(target=str(tiny_target_dir), drafter=str(tiny_drafter_dir), max_seq_len=limit // 2)
    assert fitted_max_seq_len(fits) == limit // 2
    too_long = EngineConfig(target=str(tiny_target_dir), drafter=str(tiny_drafter_dir), max_seq_len=limit + 1)
    refusal = rf"max_seq_len {limit + 1} is longer than the target's context length {limit}"
    with pytest.raises(ValueError, match=refusal):
        fitted_max_seq_len(too_long)
    with pytest.raises(ValueError, match="set max_seq_len to"):
        LLM(str(tiny_target_dir), str(tiny_drafter_dir), max_seq_len=limit + 1)


def test_a_cap_that_leaves_no_room_beside_the_tree_is_refused(
    tiny_target_dir: Path, tiny_drafter_dir: Path
) -> None:
    """`EngineConfig` checks the default 2048 against the budget; the cap is checked here."""
    limit = target_context_length(tiny_target_dir)
    config = EngineConfig(target=str(tiny_target_dir), drafter=str(tiny_drafter_dir), budget=limit)
    with pytest.raises(
        ValueError, match=rf"context length {limit} leaves no room .*\(budget \+ 1 = {limit + 1}"
    ):
        fitted_max_seq_len(config)
    assert fitted_max_seq_len(config.model_copy(update={"budget": limit - 2})) == limit


def test_a_slot_too_short_for_one_drafted_block_is_refused() -> None:
    """Mode 'chain' drafts a whole block, known only once the drafter loads (16 for the bundled)."""
    with pytest.raises(ValueError, match=r"beside one step's tree of 16 positions \(mode 'chain'\)"):
        LLM(mode="chain", max_seq_len=16)
    assert LLM(mode="chain", max_seq_len=17).engine.max_prompt_tokens == 1


def test_a_tensor_parallel_rank_refuses_the_length_before_joining_its_group(
    tiny_target_dir: Path, tiny_drafter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused length needs no group: each rank refuses before the rendezvous, which blocks
    until every rank of the group has joined."""

    def join_group(*_args: object) -> None:
        raise AssertionError("joined the group")

    monkeypatch.setattr(builder, "join_group", join_group)
    limit = target_context_length(tiny_target_dir)
    config = EngineConfig(target=str(tiny_target_dir), drafter=str(tiny_drafter_dir), max_seq_len=limit + 1)
    with pytest.raises(ValueError, match="longer than the target's context length"):
        TargetRankFactory(config, RankSpec(0, 2, "tcp://127.0.0.1:1"))()
