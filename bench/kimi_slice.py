"""A Kimi K2.6-shaped slice on one GPU: the cost of a verify forward over N tree tokens.

Two decoder layers at the true K2.6 shapes (MLA: hidden 7168, 64 heads, q_lora 1536, kv_lora 512,
rope 64 / nope 128 / v 128; MoE: 384 routed INT4 experts of width 2048, top-8, one shared
expert), random weights, bf16 activations, run through `TargetRunner.verify` on top of a cached
prefix, for N = 1, 8, 16, 32, 64, 128 tree tokens (DDTree shapes from random draft logits) at
batch 1, 4 and 16. Per point: ms per layer (median of CUDA-event timings), the distinct routed
experts the call touched (per layer), and the bytes-moved floor at the H200's ~4.8 TB/s
(attention, router and shared-expert weights, the touched experts' packed weights and scales,
and the KV prefix read; activations left out).

The cost curve goes to `bench/out/kimi_slice.json` (`ms_per_layer[batch][n]`, the file an
adaptive-budget engine reads) and a markdown table to stdout.

    python bench/kimi_slice.py                      # H200: the true shapes
    python bench/kimi_slice.py --smoke              # CPU: tiny shapes, checks the script runs
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ddtree_serve.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from ddtree_serve.models.int4_experts import Int4Experts
from ddtree_serve.models.moe import TopKRouter
from ddtree_serve.models.random_weights import randomize_
from ddtree_serve.models.runner import TargetRunner
from ddtree_serve.tree import build_ddtree, build_verify_batch, draft_topk

SLICE_TREE_TOKENS = (1, 8, 16, 32, 64, 128)
SLICE_BATCHES = (1, 4, 16)
H200_BYTES_PER_S = 4.8e12
INT4_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            },
        }
    },
}


def k26_slice_config(num_layers: int = 2) -> dict:
    """K2.6's text_config at its true widths, cut to `num_layers` MoE layers (small vocab: not timed)."""
    return {
        "model_type": "kimi_k2",
        "vocab_size": 1024,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "routed_scaling_factor": 2.827,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 262144,
        "quantization_config": INT4_QUANTIZATION,
    }


def smoke_config() -> dict:
    """Tiny widths with the same structure, for a CPU run of the script."""
    return {
        **k26_slice_config(),
        "vocab_size": 64,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
    }


def random_slice_model(config: dict, device: str, dtype: torch.dtype, seed: int) -> DeepseekV3ForCausalLM:
    """Random weights: fan-in-scaled bf16 layers, random INT4 words, scales for unit-ish outputs."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(config))
    randomize_(model, seed, std=config["hidden_size"] ** -0.5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Int4Experts):
                for packed in (module.gate_up_packed, module.down_packed):
                    packed.view(torch.uint8).random_(0, 256)
                for scale in (module.gate_up_scale, module.down_scale):
                    fan_in = scale.shape[-1] * module.group_size
                    scale.uniform_(0.5, 1.5).mul_(0.25 * fan_in**-0.5)
    return model.to(dtype).eval()


def verify_batch_of(num_tokens: int, batch: int, vocab: int, seed: int):
    """`batch` DDTrees of `num_tokens` nodes (root included) from random block-8 draft logits."""
    generator = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(batch):
        logits = torch.randn(7, vocab, generator=generator) * 3
        logp, ids = draft_topk(logits, min(num_tokens, vocab))
        trees.append(build_ddtree(logp, ids, budget=num_tokens - 1, root_token=0))
    return build_verify_batch(trees)


def timer_for(device: str) -> Callable[[Callable[[], object]], float]:
    """Milliseconds of one call: CUDA events on a GPU, wall clock on the CPU."""
    if device.startswith("cuda"):

        def time_cuda(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return time_cuda

    def time_cpu(fn: Callable[[], object]) -> float:
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    return time_cpu


def distinct_experts_per_layer(model: DeepseekV3ForCausalLM, call: Callable[[], object]) -> float:
    """Mean over the MoE layers of the distinct routed experts one call selects (an untimed pass)."""
    counts: list[int] = []
    hooks = [
        module.register_forward_hook(lambda _m, _i, out: counts.append(int(out[1].unique().numel())))
        for module in model.modules()
        if isinstance(module, TopKRouter)
    ]
    call()
    for hook in hooks:
        hook.remove()
    return sum(counts) / len(counts)


def floor_bytes_per_layer(model: DeepseekV3ForCausalLM, distinct_experts: float, kv_bytes: int) -> float:
    """Bytes one MoE layer must read: its dense weights, the touched experts, the KV prefix."""
    layer = model.model.layers[0]
    experts = layer.mlp.experts
    routed = "mlp.experts."
    dense = sum(p.numel() * p.element_size() for name, p in layer.named_parameters() if routed not in name)
    dense += sum(b.numel() * b.element_size() for name, b in layer.named_buffers() if routed not in name)
    per_expert = sum(b[0].numel() * b.element_size() for b in experts.buffers())
    return dense + distinct_experts * per_expert + kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument("--prefix-len", type=int, default=None, help="cached tokens per slot (default 1024)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per point (default 10)")
    parser.add_argument("--out", type=Path, default=None, help="default bench/out/kimi_slice[_smoke].json")
    args = parser.parse_args()
    device = args.device or ("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = smoke_config() if args.smoke else k26_slice_config()
    tree_tokens, batches = ((1, 8), (1, 4)) if args.smoke else (SLICE_TREE_TOKENS, SLICE_BATCHES)
    prefix_len = args.prefix_len or (16 if args.smoke else 1024)
    reps = args.reps or (2 if args.smoke else 10)
    out = args.out or Path("bench/out") / ("kimi_slice_smoke.json" if args.smoke else "kimi_slice.json")

    model = random_slice_model(config, device, dtype, seed=0)
    num_layers = config["num_hidden_layers"]
    max_batch = max(batches)
    runner = TargetRunner(model, num_slots=max_batch, max_seq_len=prefix_len + max(tree_tokens) + 1)
    prompt = torch.randint(0, config["vocab_size"], (prefix_len,), generator=torch.Generator().manual_seed(1))
    runner.prefill_batch(list(range(max_batch)), [prompt] * max_batch)
    layout = model.config.kv_layout
    kv_token_bytes = layout.num_heads * (layout.key_dim + layout.value_dim) * torch.finfo(dtype).bits // 8
    time_ms = timer_for(device)

    entries = []
    for batch in batches:
        slots = list(range(batch))
        for num_tokens in tree_tokens:
            tree = verify_batch_of(num_tokens, batch, config["vocab_size"], seed=num_tokens)
            call = lambda: runner.verify(slots, tree)  # noqa: B023 (called in this loop)
            distinct = distinct_experts_per_layer(model, call)
            for _ in range(2):  # warm-up (kernel compiles, allocator)
                call()
            ms = statistics.median(time_ms(call) for _ in range(reps)) / num_layers
            floor = floor_bytes_per_layer(model, distinct, batch * prefix_len * kv_token_bytes)
            entries.append(
                {
                    "batch": batch,
                    "tree_tokens": num_tokens,
                    "ms_per_layer": ms,
                    "distinct_experts": distinct,
                    "floor_ms_per_layer": floor / H200_BYTES_PER_S * 1e3,
                }
            )
    result = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "smoke": args.smoke,
        "prefix_len": prefix_len,
        "num_layers_timed": num_layers,
        "hbm_bytes_per_s": H200_BYTES_PER_S,
        "kv_cache": "decompressed MLA (per-head K/V)",
        "ms_per_layer": {
            str(b): {str(e["tree_tokens"]): e["ms_per_layer"] for e in entries if e["batch"] == b}
            for b in batches
        },
        "entries": entries,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Kimi K2.6 slice, {result['device']}, {result['dtype']}, prefix {prefix_len} tokens per slot")
    print("| batch | tree tokens | ms / layer | distinct experts / layer | floor ms / layer | x floor |")
    print("|---:|---:|---:|---:|---:|---:|")
    for e in entries:
        ratio = e["ms_per_layer"] / e["floor_ms_per_layer"]
        print(
            f"| {e['batch']} | {e['tree_tokens']} | {e['ms_per_layer']:.3f} | {e['distinct_experts']:.1f} "
            f"| {e['floor_ms_per_layer']:.3f} | {ratio:.1f} |"
        )
    print(f"cost curve written to {out}")


if __name__ == "__main__":
    main()
