"""Kimi K2.6 as it ships (`kimi_k25`, INT4 pack-quantized experts) through TargetRunner.

The reference is transformers' DeepseekV3 run on the dequantized weights (compressed-tensors'
own decompression): prefill, decode and tree verify (over the latent MLA cache, the runner's
default) give the same logits within float32 tolerance, while the routed experts stay packed
int32 in memory.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

from ddtree_serve.models.deepseek_v3 import DeepseekV3Config
from ddtree_serve.models.int4_experts import Int4Experts
from ddtree_serve.models.loading import load_embedding_and_head, load_target_model
from ddtree_serve.models.quantization import UnsupportedQuantizationError, dequantize_int4, unpack_int4
from ddtree_serve.models.runner import TargetRunner
from tests.models.kimi_dirs import (
    INT4_SCHEME,
    KIMI_TEXT_CONFIG,
    pack_int4,
    save_hf_deepseek_v3,
    write_kimi_k25_dir,
)
from tests.models.runner_checks import TOL, check_prefill_and_decode_match_hf
from tests.models.trees import path_to, random_parents, tree_inputs

LAYER_IDS = (0, 2)


@pytest.fixture(scope="module")
def kimi_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.DeepseekV3ForCausalLM]:
    root = tmp_path_factory.mktemp("kimi_k25")
    hf_dir = save_hf_deepseek_v3(root / "hf", KIMI_TEXT_CONFIG)
    write_kimi_k25_dir(hf_dir, root / "kimi", root / "dequantized")
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(root / "dequantized", dtype=torch.float32)
    return root / "kimi", reference.eval()


def test_unpacking_matches_compressed_tensors() -> None:
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    packed = pack_int4(weight)
    shape = torch.Size(packed["weight_shape"].tolist())
    expected_values = unpack_from_int32(packed["weight_packed"], 4, shape)
    assert torch.equal(unpack_int4(packed["weight_packed"], 96), expected_values)
    weight_int4 = dequantize_int4(packed["weight_packed"], packed["weight_scale"])
    assert torch.equal(weight_int4, PackedQuantizationCompressor.decompress(packed, INT4_SCHEME)["weight"])
    # within half a quantization step of the original (bf16 rounding aside): INT4, not garbage
    half_step = packed["weight_scale"].float().repeat_interleave(32, dim=-1) / 2
    assert ((weight_int4.float() - weight).abs() <= half_step * 1.01 + 1e-3).all()


def test_kimi_k25_loads_text_model_with_packed_experts(kimi_dirs: tuple[Path, object]) -> None:
    model = load_target_model(kimi_dirs[0])
    assert model.has_vision_tower
    assert model.config.weight_prefix == "language_model."
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, Int4Experts)
    assert experts.gate_up_packed.dtype == torch.int32 and experts.gate_up_packed.shape == (8, 64, 8)
    assert experts.down_packed.shape == (8, 64, 4) and experts.down_scale.shape == (8, 64, 1)
    assert not any(name.startswith(("vision_tower", "mm_projector")) for name in model.state_dict())
    embed, head = load_embedding_and_head(kimi_dirs[0])
    assert torch.equal(embed, model.model.embed_tokens.weight) and torch.equal(head, model.lm_head.weight)


def test_prefill_and_decode_match_transformers_on_dequantized_weights(kimi_dirs: tuple[Path, object]) -> None:
    path, reference = kimi_dirs
    runner = TargetRunner.from_pretrained(path, num_slots=2, max_seq_len=64, target_layer_ids=LAYER_IDS)
    assert runner.eos_token_ids == (5,)
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    check_prefill_and_decode_match_hf(runner, reference, ids, num_prompt=12, slot=1)


def test_tree_verify_matches_transformers_on_dequantized_weights(kimi_dirs: tuple[Path, object]) -> None:
    path, reference = kimi_dirs
    runner = TargetRunner.from_pretrained(path, num_slots=3, max_seq_len=48, target_layer_ids=LAYER_IDS)
    gen = torch.Generator().manual_seed(11)
    slots, prompts = [2, 0], [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (9, 4)]
    trees = [(torch.randint(0, 97, (n,), generator=gen).tolist(), random_parents(n, gen)) for n in (10, 6)]
    for slot, prompt in zip(slots, prompts, strict=True):
        runner.prefill(slot, prompt)
    logits, _ = runner.verify(slots, tree_inputs(trees, padded_num_nodes=10))
    for b, (token_ids, parents) in enumerate(trees):
        for node in range(len(token_ids)):
            path_ids = prompts[b] + [token_ids[i] for i in path_to(parents, node)]
            with torch.no_grad():
                expected = reference(torch.tensor([path_ids])).logits[0, -1]
            assert (logits[b, node] - expected).abs().max() < TOL, (b, node)


def _kimi_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"format": "float-quantized"}, "float-quantized"),
        ({"num_bits": 8}, "int8"),
        ({"group_size": 128}, "group_size=128"),
        ({"symmetric": False}, "asymmetric"),
        ({"input_activations": {"num_bits": 8, "type": "int"}}, "activation quantization"),
    ],
)
def test_other_quantization_schemes_are_one_line_naming_them(
    kimi_dirs: tuple[Path, object], change: dict, named: str
) -> None:
    config = _kimi_config(kimi_dirs[0])
    quant = json.loads(json.dumps(config["text_config"]["quantization_config"]))
    group = quant["config_groups"]["group_0"]
    if "format" in change:
        quant["format"] = change["format"]
    elif "input_activations" in change:
        group["input_activations"] = change["input_activations"]
    else:
        group["weights"].update(change)
    config["text_config"]["quantization_config"] = quant
    with pytest.raises(UnsupportedQuantizationError, match=named) as refused:
        DeepseekV3Config.from_dict(config)
    assert "\n" not in str(refused.value)


def test_other_quant_methods_and_wrapped_model_types_are_refused(kimi_dirs: tuple[Path, object]) -> None:
    config = _kimi_config(kimi_dirs[0])
    fp8 = {**config, "text_config": {**config["text_config"], "quantization_config": {"quant_method": "fp8"}}}
    with pytest.raises(UnsupportedQuantizationError, match="'fp8'"):
        DeepseekV3Config.from_dict(fp8)
    qwen = {**config, "text_config": {**config["text_config"], "model_type": "qwen3"}}
    with pytest.raises(ValueError, match="'qwen3'"):
        DeepseekV3Config.from_dict(qwen)
