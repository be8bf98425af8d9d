"""Our Qwen3 decoder against transformers' implementation, loaded from the same directory."""

from pathlib import Path

import pytest
import torch

from ddtree_serve.models.layers import causal_mask
from ddtree_serve.models.loading import load_target_model
from ddtree_serve.models.qwen3 import context_features
from tests.models.hf_qwen3 import save_hf_qwen3


@pytest.mark.parametrize("tie", [True, False])
def test_full_sequence_logits_match_transformers(tmp_path: Path, tie: bool) -> None:
    hf_model = save_hf_qwen3(tmp_path, tie=tie)
    ours = load_target_model(tmp_path)
    input_ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(input_ids, output_hidden_states=True)
        out = ours(input_ids, torch.arange(11).expand(2, 11), causal_mask(11), output_layer_ids=(0, 1))
        logits = ours.logits(out.hidden)
    assert (logits - expected.logits).abs().max() < 1e-4
    # DFlash feature convention: layer id i is HF hidden_states[i + 1]
    features = context_features(out, (0, 1))
    hf_features = torch.cat([expected.hidden_states[1], expected.hidden_states[2]], dim=-1)
    assert (features - hf_features).abs().max() < 1e-4
