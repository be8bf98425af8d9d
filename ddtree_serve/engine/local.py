"""The in-process engine: `SpecEngine` calling the target and draft steps directly.

No transport: the context handle is the list of device tensors `TargetStep` made, so the
drafter reads the target's features without a copy. One `StageTimer` serves the engine and both steps, so the
forward passes are timed inside their stages.
"""

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.builder import build_draft_step, build_target_step, stage_timer, target_dir
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.engine.tree_builder import TreeBuilder
from ddtree_serve.models import load_tokenizer


def build_local_engine(config: EngineConfig) -> SpecEngine:
    """Load the target (and the drafter, unless mode 'ar') and wire an in-process `SpecEngine`."""
    timer = stage_timer(config)
    drafter = build_draft_step(config, timer) if config.mode != "ar" else None
    target = build_target_step(config, timer)
    tokenizer = load_tokenizer(target_dir(config))
    tree_builder = TreeBuilder(capture=not config.enforce_eager)
    return SpecEngine(config.to_settings(), target, drafter, tokenizer, timer, tree_builder)
