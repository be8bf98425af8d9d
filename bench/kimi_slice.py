"""A Kimi K2.6-shaped slice on one GPU: the cost of a verify forward over N tree tokens.

Two decoder layers at the true K2.6 shapes (MLA: hidden 7168, 64 heads, q_lora 1536, kv_lora 512,
rope 64 / nope 128 / v 128; MoE: 384 routed INT4 experts of width 2048, top-8, one shared
expert), random weights, bf16 activations, run through `TargetRunner.verify` on top of a cached
prefix, for N = 1, 8, 16, 32, 64, 128 tree tokens (DDTree shapes from random draft logits) at
batch 1, 4 and 16. Routing is the model's own router over random weights scaled as a trained
router's (`--routing router`), or expert ids drawn uniformly (`--routing uniform`, the
assumption of the design's bf16 figures). Per point (medians of CUDA-event timings):
  - ms per layer eager (`TargetRunner.verify`) and replayed from a CUDA graph (`TargetGraphs`:
    the INT4 path routes on the device, so the whole verify captures);
  - ms of layer 0's routed experts alone (the grouped W4A16 GEMMs and their routing plan, graph);
  - the distinct routed experts the call touched (mean over the layers);
  - the bytes-moved floor at the H200's ~4.8 TB/s, for the layer (attention, router and
    shared-expert weights, the touched experts' packed weights and scales, the KV prefix read;
    activations left out) and for the touched experts alone.

The cost curve goes to `bench/out/kimi_slice.json` (`ms_per_layer[batch][n]`, graph timings on
CUDA: the file an adaptive-budget engine reads; `_uniform` appended for uniform routing) and a
markdown table to stdout; `--profile` appends torch.profiler tables of two eager verifies to
`<out>.profile.txt`.

    python bench/kimi_slice.py                      # H200: the true shapes
    python bench/kimi_slice.py --routing uniform    # H200: uniformly drawn experts
    python bench/kimi_slice.py --smoke              # CPU: tiny shapes, checks the script runs
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddtree_serve.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from ddtree_serve.models.int4_experts import Int4Experts
from ddtree_serve.models.moe import MoEShape, TopKRouter
from ddtree_serve.models.random_weights import randomize_
from ddtree_serve.models.runner import TargetRunner
from ddtree_serve.models.target_graphs import TargetGraphs
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
    """Random weights: fan-in-scaled bf16 layers, random INT4 words, scales for unit-ish outputs.

    The router is filled too (`randomize_` knows only Linear and Embedding layers, and an
    unfilled router is all zeros or garbage: every score ties and every token picks the same
    experts). Its rows are drawn with std `hidden ** -0.5`, so on the normed hidden state a
    token's expert logits spread with std about 1, as a trained router's do; the correction bias
    stays zero (with i.i.d. rows the experts are balanced in expectation, the job the learned bias
    does; a bias large against the score spread would instead pick the same experts for every
    token). The router stays float32, as the checkpoint loader keeps it.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(config))
    randomize_(model, seed, std=config["hidden_size"] ** -0.5)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Int4Experts):
                for packed in (module.gate_up_packed, module.down_packed):
                    packed.view(torch.uint8).random_(0, 256, generator=generator)
                for scale in (module.gate_up_scale, module.down_scale):
                    fan_in = scale.shape[-1] * module.group_size
                    scale.uniform_(0.5, 1.5, generator=generator).mul_(0.25 * fan_in**-0.5)
            elif isinstance(module, TopKRouter):
                module.weight.normal_(0.0, config["hidden_size"] ** -0.5, generator=generator)
                module.e_score_correction_bias.zero_()
    model = model.to(dtype).eval()
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.float()
    return model


class UniformRouter(nn.Module):
    """`--routing uniform`: each token's k experts drawn uniformly without replacement, equal weights.

    The routing the design's bf16 figures assume; draws on the device's generator, so a CUDA
    graph replays fresh draws.
    """

    def __init__(self, shape: MoEShape) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.shape
        draws = torch.rand(x.shape[0], shape.num_experts, device=x.device)  # [N, E]
        expert_ids = draws.topk(shape.top_k, dim=-1).indices  # [N, k]
        weights = torch.full(expert_ids.shape, shape.routed_scaling_factor / shape.top_k, device=x.device)
        return weights, expert_ids


def use_uniform_routing_(model: DeepseekV3ForCausalLM) -> None:
    for layer in model.model.layers:
        layer.mlp.gate = UniformRouter(layer.mlp.gate.shape)


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


def median_ms(time_ms: Callable[[Callable[[], object]], float], fn: Callable[[], object], reps: int) -> float:
    for _ in range(2):  # warm-up (kernel compiles, allocator, graph capture)
        fn()
    return statistics.median(time_ms(fn) for _ in range(reps))


def captured(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured once in a CUDA graph -> its replay (warm-up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@dataclass
class RoutingRecord:
    """What one untimed pass routed: distinct experts per MoE layer, and layer 0's expert inputs."""

    distinct_experts: list[int]
    expert_inputs: tuple[torch.Tensor, ...] = ()


def record_routing(model: DeepseekV3ForCausalLM, call: Callable[[], object]) -> RoutingRecord:
    """Run `call` once, counting the distinct routed experts each MoE layer's router selected."""
    record = RoutingRecord([])
    layers = model.model.layers

    def count(_module: nn.Module, _inputs: object, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        record.distinct_experts.append(int(out[1].unique().numel()))

    def keep(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        record.expert_inputs = tuple(t.clone() for t in inputs)

    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in layers]
    hooks.append(layers[0].mlp.experts.register_forward_pre_hook(keep))
    call()
    for hook in hooks:
        hook.remove()
    return record


def floor_bytes_per_layer(
    model: DeepseekV3ForCausalLM, distinct_experts: float, kv_bytes: int
) -> tuple[float, float]:
    """Bytes one MoE layer must read -> (whole layer, touched experts alone).

    The whole layer: its dense weights (attention, router, shared expert), the touched experts'
    packed words and scales, the KV prefix.
    """
    layer = model.model.layers[0]
    experts = layer.mlp.experts
    routed = "mlp.experts."
    dense = sum(p.numel() * p.element_size() for name, p in layer.named_parameters() if routed not in name)
    dense += sum(b.numel() * b.element_size() for name, b in layer.named_buffers() if routed not in name)
    per_expert = sum(b[0].numel() * b.element_size() for b in experts.buffers())
    touched = distinct_experts * per_expert
    return dense + touched + kv_bytes, touched


def write_profile(path: Path, call: Callable[[], object], title: str) -> None:
    """torch.profiler over one call: kernels launched and the top GPU-time rows, appended to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    with path.open("a") as f:
        f.write(f"## {title}: {len(kernels)} GPU kernels\n{table}\n")


@dataclass
class SliceBench:
    """One prefilled slice and how to time it; `measure` gives one row of the cost curve."""

    model: DeepseekV3ForCausalLM
    runner: TargetRunner
    graphs: TargetGraphs | None  # None: eager only (the CPU)
    time_ms: Callable[[Callable[[], object]], float]
    reps: int
    prefix_len: int
    kv_token_bytes: int

    def measure(self, batch: int, num_tokens: int, profile_path: Path | None) -> dict:
        """ms per layer of a verify of `batch` trees of `num_tokens` nodes, eager and from a graph."""
        num_layers = self.model.config.num_hidden_layers
        slots = list(range(batch))
        starts = self.runner.cache.slot_lengths(slots)
        tree = verify_batch_of(num_tokens, batch, self.model.config.vocab_size, seed=num_tokens)

        def eager_call() -> object:
            return self.runner.verify(slots, tree)

        routing = record_routing(self.model, eager_call)
        distinct = statistics.mean(routing.distinct_experts)
        eager_ms = median_ms(self.time_ms, eager_call, self.reps) / num_layers
        entry: dict = {"batch": batch, "tree_tokens": num_tokens, "ms_per_layer_eager": eager_ms}
        if self.graphs is not None:
            graphs = self.graphs
            experts = self.model.model.layers[0].mlp.experts
            entry["ms_per_layer_graph"] = (
                median_ms(self.time_ms, lambda: graphs.verify(slots, tree, starts), self.reps) / num_layers
            )
            experts_replay = captured(lambda: experts(*routing.expert_inputs))
            entry["ms_routed_experts_graph"] = median_ms(self.time_ms, experts_replay, self.reps)
        if profile_path is not None:
            write_profile(profile_path, eager_call, f"eager verify, batch {batch}, {num_tokens} tree tokens")
        kv_bytes = batch * self.prefix_len * self.kv_token_bytes
        floor, experts_floor = floor_bytes_per_layer(self.model, distinct, kv_bytes)
        return entry | {
            "ms_per_layer": entry.get("ms_per_layer_graph", eager_ms),
            "distinct_experts": distinct,
            "floor_ms_per_layer": floor / H200_BYTES_PER_S * 1e3,
            "floor_ms_routed_experts": experts_floor / H200_BYTES_PER_S * 1e3,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument(
        "--routing",
        choices=("router", "uniform"),
        default="router",
        help="router: the model's sigmoid top-k over random router weights; uniform: ids drawn uniformly",
    )
    parser.add_argument("--prefix-len", type=int, default=None, help="cached tokens per slot (default 1024)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per point (default 10)")
    parser.add_argument("--out", type=Path, default=None, help="default bench/out/kimi_slice[_smoke].json")
    parser.add_argument("--profile", action="store_true", help="torch.profiler of eager verifies (CUDA)")
    args = parser.parse_args()
    device = args.device or ("cpu" if args.smoke else "cuda")
    on_cuda = device.startswith("cuda")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = smoke_config() if args.smoke else k26_slice_config()
    tree_tokens, batches = ((1, 8), (1, 4)) if args.smoke else (SLICE_TREE_TOKENS, SLICE_BATCHES)
    prefix_len = args.prefix_len or (16 if args.smoke else 1024)
    reps = args.reps or (2 if args.smoke else 10)
    suffix = ("_smoke" if args.smoke else "") + ("_uniform" if args.routing == "uniform" else "")
    out = args.out or Path("bench/out") / f"kimi_slice{suffix}.json"
    profile_path = out.with_suffix(".profile.txt")
    if args.profile:
        profile_path.unlink(missing_ok=True)

    model = random_slice_model(config, device, dtype, seed=0)
    if args.routing == "uniform":
        use_uniform_routing_(model)
    num_layers = config["num_hidden_layers"]
    max_batch = max(batches)
    # one slot past the batch is never filled: the graphs' scratch slot for padded rows
    # the decompressed cache, as the committed cost curve (bench/costs/) was measured
    runner = TargetRunner(
        model,
        num_slots=max_batch + 1,
        max_seq_len=prefix_len + max(tree_tokens) + 1,
        enforce_eager=True,
        mla_cache="decompressed",
    )
    graphs = TargetGraphs(model, runner.cache, (), scratch_slot=max_batch, capture=True) if on_cuda else None
    prompt = torch.randint(0, config["vocab_size"], (prefix_len,), generator=torch.Generator().manual_seed(1))
    runner.prefill_batch(list(range(max_batch)), [prompt] * max_batch)
    layout = model.config.kv_layout
    kv_token_bytes = layout.num_heads * (layout.key_dim + layout.value_dim) * torch.finfo(dtype).bits // 8
    bench = SliceBench(model, runner, graphs, timer_for(device), reps, prefix_len, kv_token_bytes)
    entries = []
    for batch in batches:
        for num_tokens in tree_tokens:
            profile = (
                args.profile and on_cuda and (batch, num_tokens) in ((1, 1), (max_batch, max(tree_tokens)))
            )
            entries.append(bench.measure(batch, num_tokens, profile_path if profile else None))
    result = {
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "smoke": args.smoke,
        "routing": args.routing,
        "timing": "cuda_graph" if graphs is not None else "eager",
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
    print_table(result)
    print(f"cost curve written to {out}")


def print_table(result: dict) -> None:
    """The markdown table of one run (graph columns only where graphs were timed)."""
    print(
        f"Kimi K2.6 slice, {result['device']}, {result['dtype']}, {result['routing']} routing, "
        f"prefix {result['prefix_len']} tokens per slot, ms_per_layer from {result['timing']}"
    )
    print(
        "| batch | tree tokens | distinct experts / layer | ms / layer (eager) | ms / layer (graph) "
        "| x floor | routed experts ms (graph) | x experts floor | floor ms / layer |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e in result["entries"]:
        graph = e.get("ms_per_layer_graph", float("nan"))
        experts = e.get("ms_routed_experts_graph", float("nan"))
        ratio = e["ms_per_layer"] / e["floor_ms_per_layer"]
        print(
            f"| {e['batch']} | {e['tree_tokens']} | {e['distinct_experts']:.1f} "
            f"| {e['ms_per_layer_eager']:.3f} | {graph:.3f} | {ratio:.1f} | {experts:.3f} "
            f"| {experts / e['floor_ms_routed_experts']:.1f} | {e['floor_ms_per_layer']:.3f} |"
        )


if __name__ == "__main__":
    main()
