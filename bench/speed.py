"""Decoding speed of ar, chain and ddtree side by side, against HF transformers, on CPU or CUDA.

For every scenario (batch size x temperature) and every decoding config (ar, chain, ddtree at
several budgets; on CUDA each with CUDA graphs and with `enforce_eager`) it generates the same
prompts with the same models, loaded once, and reports tokens/s, acceptance length (tokens per
verify step) and where a step's time goes:

    schedule / draft (draft_forward inside) / build / verify (target_forward inside) / append

Two passes per config, so timing never changes what it measures: tokens/s, tau and `step ms`
come from a pass with stage timing off (wall time of whole runs, prefill included, over the
steps); the stage columns come from a second, timed pass, where on CUDA each stage is the span
between CUDA events recorded at its start and end (no synchronize), on a CPU its wall clock.
`overhead` is the share of a (timed) step spent outside the two forward passes (tree build,
buffers, verification walk, KV compaction, bookkeeping). `--tree-builders host,device` adds
the device tree build (one sync per step) as a dimension next to the default host build.
The reference every ratio is taken against is HF transformers' own greedy decoding of the same
target (`AutoModelForCausalLM.generate`, SDPA attention, the same prompts and new
tokens, batches left-padded), timed in the same run. Results go to bench/out/speed.{md,json,png}.

    python bench/speed.py                                    # bundled pair, CPU
    python bench/speed.py --device cuda --dtype bfloat16     # H200: graphs on and off
    python bench/speed.py --target T --drafter D --budgets 16,32,64 --batch-sizes 1,16
"""

import argparse
import json
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.builder import build_draft_step, build_target_step, stage_timer, target_dir
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.settings import EngineSettings
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.engine.timing import MODEL_STAGES, STEP_STAGES, Stage
from ddtree_serve.engine.tree_builder import TreeBuilder
from ddtree_serve.models import load_tokenizer

# Openings in the style of the standard library the bundled pair was trained on (written for
# this benchmark); acceptance length depends on how in-distribution the text is.
PROMPTS = [
    "def _check_arg_types(funcname, *args):\n    hasstr = hasbytes = False\n    for s in args:\n",
    'class Error(Exception):\n    """Base class for exceptions in this module."""\n    pass\n\n\nclass ',
    "import os\nimport sys\nimport re\n\n__all__ = [",
    'def split(p):\n    """Split a pathname.\n\n    Return tuple (head, tail) where tail is everything '
    'after the final slash.\n    """\n',
    '    def __init__(self, stream, errors="strict"):\n        self.stream = stream\n',
    "def getattr_static(obj, attr, default=_sentinel):\n"
    '    """Retrieve attributes without triggering dynamic lookup.\n',
    'if __name__ == "__main__":\n    import ',
    '    def close(self):\n        """Close the file."""\n        if self._file is not None:\n',
    "def _parse_header(line):\n    parts = line.split(';')\n    key = parts[0].strip()\n",
    'class Counter(dict):\n    """Dict subclass for counting hashable items."""\n\n'
    "    def __init__(self, iterable=None, /, **kwds):\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, ",
    "def _get_default_tempdir():\n    namer = _RandomNameSequence()\n"
    "    dirlist = _candidate_tempdir_list()\n",
    "try:\n    import _thread\nexcept ImportError:\n    ",
    '    @property\n    def name(self):\n        """The name of the underlying file."""\n',
    "def readlines(self, hint=-1):\n    lines = []\n    total = 0\n    while True:\n",
    'class Timeout(Exception):\n    """Raised when a lock cannot be acquired in time."""\n\n\ndef ',
]
STEP_TIME_STAGES = tuple(stage for stage in STEP_STAGES if stage is not Stage.PREFILL)


@dataclass(frozen=True)
class Result:
    mode: str  # "hf" for the transformers baseline
    budget: int
    graphs: bool
    tree_builder: str  # "host" (the default) or "device"
    batch_size: int
    temperature: float
    num_tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_length: float
    steps: int
    step_ms: float  # wall time of the untimed pass over its steps (prefill included)
    stage_ms: dict[str, float]  # per step, from the timed pass (CUDA events on CUDA)
    overhead: float  # share of the timed step outside draft_forward + target_forward

    @property
    def label(self) -> str:
        label = self.mode if self.mode != "ddtree" else f"ddtree-{self.budget}"
        return label if self.tree_builder == "host" else f"{label} (device build)"


class Workers:
    """Models loaded once; every config reuses them (slots are released after each run)."""

    def __init__(self, args: argparse.Namespace, num_slots: int, max_seq_len: int, graphs: bool) -> None:
        config = EngineConfig(
            target=args.target,
            drafter=args.drafter,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=num_slots,
            max_seq_len=max_seq_len,
            verify_backend=args.verify_backend,
            record_timings=True,
            enforce_eager=not graphs,
        )
        self.timer = stage_timer(config)  # switched on for the timed passes only
        self.drafter = build_draft_step(config, self.timer)
        self.target = build_target_step(config, self.timer)
        self.tokenizer = load_tokenizer(target_dir(config))
        self.max_seq_len = max_seq_len
        self.graphs = graphs

        self.tree_builders = {
            name: TreeBuilder(name, capture=graphs)  # type: ignore[arg-type]
            for name in ("host", "device")
        }

    def engine(self, mode: str, budget: int, batch_size: int, tree_builder: str = "host") -> SpecEngine:
        settings = EngineSettings(
            mode=mode,  # type: ignore[arg-type]
            budget=budget,
            max_num_seqs=batch_size,
            max_num_batched_tokens=1 << 20,
            max_seq_len=self.max_seq_len,
            record_timings=True,
        )
        return SpecEngine(
            settings, self.target, self.drafter, self.tokenizer, self.timer, self.tree_builders[tree_builder]
        )


@dataclass
class Totals:
    """Sums over the rounds of one config (rounds interleave configs, so load drift hits all)."""

    num_tokens: int = 0
    seconds: float = 0.0
    step_tokens: float = 0.0  # tokens produced by verify steps, before stop truncation
    request_steps: int = 0
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    timed_steps: int = 0  # steps of the timed passes
    steps: int = 0  # steps of the untimed passes
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> new tokens


class HFBaseline:
    """HF transformers' greedy decoding of the same target directory: the reference of every ratio.

    `generate` with its default dynamic cache and SDPA attention; batches are left-padded (pad
    id 0, masked out) and every sequence makes exactly `max_tokens` new tokens, as ours do
    with `ignore_eos`.
    """

    def __init__(self, target_dir: Path, device: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa")
        self.model.to(device).eval()
        self.device = device

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        attention_mask = torch.zeros(len(prompts), width, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            input_ids[b, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[b, width - len(prompt) :] = 1
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[:, width:].tolist()


def run_hf_once(hf: HFBaseline, tokenizer, batch_size: int, args, totals: Totals) -> None:
    """Warm up, then generate every prompt in batches of `batch_size` and add to `totals`."""
    count = max(batch_size, args.num_prompts)
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(count)]
    hf.generate(prompts[:batch_size], 8)
    _synchronize(args.device)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        for offset, new_tokens in enumerate(
            hf.generate(prompts[first : first + batch_size], args.max_tokens)
        ):
            totals.token_ids[first + offset] = new_tokens
    _synchronize(args.device)
    totals.seconds += time.perf_counter() - start
    totals.num_tokens += len(prompts) * args.max_tokens
    totals.step_tokens += len(prompts) * args.max_tokens
    totals.request_steps += len(prompts) * args.max_tokens
    totals.steps += -(-len(prompts) // batch_size) * args.max_tokens


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(
    workers: Workers,
    mode: str,
    budget: int,
    tree_builder: str,
    batch_size: int,
    temperature: float,
    args,
    totals: Totals,
):
    """Warm up, then generate every prompt twice (untimed, then timed) and add to `totals`."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(batch_size, args.num_prompts))]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=0, ignore_eos=True)
    warmup = workers.engine(mode, budget, batch_size, tree_builder)
    for i in range(batch_size):
        warmup.add_request(
            f"w{i}", prompts[i], SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True)
        )
    workers.timer.enabled = False
    _drain(warmup)

    engine = workers.engine(mode, budget, batch_size, tree_builder)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    _synchronize(args.device)
    start = time.perf_counter()
    finals, num_steps = _drain(engine)
    _synchronize(args.device)
    totals.seconds += time.perf_counter() - start
    totals.steps += num_steps
    totals.num_tokens += sum(len(f.token_ids) for f in finals)
    totals.step_tokens += sum(f.stats.acceptance_length * f.stats.steps for f in finals)
    totals.request_steps += sum(f.stats.steps for f in finals)
    totals.token_ids.update({int(f.request_id): list(f.token_ids) for f in finals})

    timed = workers.engine(mode, budget, batch_size, tree_builder)
    for i, prompt in enumerate(prompts):
        timed.add_request(str(i), prompt, params)
    workers.timer.reset()
    workers.timer.enabled = True
    _drain(timed)
    workers.timer.enabled = False
    totals.timed_steps += workers.timer.counts["verify"]
    for name, seconds in workers.timer.seconds.items():
        totals.stage_seconds[name] += seconds


def summarize(
    mode: str,
    budget: int,
    graphs: bool,
    tree_builder: str,
    batch_size: int,
    temperature: float,
    totals: Totals,
) -> Result:
    steps = totals.steps
    timed_steps = max(totals.timed_steps, 1)
    stage_ms = {
        name: 1e3 * totals.stage_seconds.get(name, 0.0) / timed_steps
        for name in (*STEP_TIME_STAGES, *MODEL_STAGES, Stage.PREFILL)
    }
    timed_step_ms = sum(stage_ms[name] for name in STEP_TIME_STAGES)
    forward_ms = stage_ms["draft_forward"] + stage_ms["target_forward"]
    return Result(
        mode=mode,
        budget=budget,
        graphs=graphs,
        tree_builder=tree_builder,
        batch_size=batch_size,
        temperature=temperature,
        num_tokens=totals.num_tokens,
        seconds=totals.seconds,
        tokens_per_s=totals.num_tokens / totals.seconds,
        acceptance_length=totals.step_tokens / totals.request_steps,
        steps=steps,
        step_ms=1e3 * totals.seconds / steps,
        stage_ms=stage_ms,
        overhead=0.0 if mode == "hf" else 1.0 - forward_ms / timed_step_ms,
    )


def profile_steps(workers: Workers, budget: int, temperature: float, num_steps: int = 20) -> None:
    """Operator-level table of `num_steps` ddtree steps at batch 1 (where the time goes), and on
    CUDA the synchronizing calls per step (torch's sync debug mode, counted outside the profile).

    With CUDA graphs the device side still lists a replay's kernels one by one; on the host
    side a replay is one `cudaGraphLaunch`.
    """
    engine = workers.engine("ddtree", budget, 1)
    params = SamplingParams(max_tokens=10_000, temperature=temperature, seed=0, ignore_eos=True)
    engine.add_request("profile", PROMPTS[0], params)
    for _ in range(3):
        engine.step()
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(num_steps):
                engine.step()
        torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchronizing" in str(w.message) for w in caught)
        print(f"\nsynchronizing CUDA calls per ddtree-{budget} step: {syncs / num_steps:.2f}")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(num_steps):
            engine.step()
    engine.abort_request("profile")
    engine.step()
    sort_by = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    graphs = "graphs" if workers.graphs else "eager"
    print(f"\nprofile: ddtree-{budget} ({graphs}), batch 1, T={temperature:g}, {num_steps} steps")
    print(profiler.key_averages().table(sort_by=sort_by, row_limit=25))
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _drain(engine: SpecEngine) -> tuple[list, int]:
    """Step until idle -> (final outputs, steps taken)."""
    finals, num_steps = [], 0
    while engine.has_unfinished_requests():
        finals.extend(o for o in engine.step() if o.finished)
        num_steps += 1
    return finals, num_steps


def markdown_table(results: list[Result], device: str) -> str:
    """One row per config: `vs hf` against HF's greedy loop at the same batch size, `vs ar`
    against our plain decoding with the same graphs setting and temperature."""
    stage_clock = "wall clock" if device.startswith("cpu") else "CUDA events"
    lines = [
        f"device: {device}",
        "",
        "tok/s, tau and step ms: untimed pass (wall time of whole runs over their steps); "
        f"draft .. overhead: a second, timed pass ({stage_clock} per stage, no syncs added), ms per step.",
        "",
        "| batch | temp | config | graphs | tok/s | vs hf | vs ar | tau | step ms "
        "| draft | build | verify | append | fwd d/t | overhead |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        hf = next(x for x in results if (x.batch_size, x.mode) == (r.batch_size, "hf"))
        if r.mode == "hf":
            lines.append(
                f"| {r.batch_size} | 0 | hf transformers | - | {r.tokens_per_s:.1f} | 1.00x | - | 1.00 | "
                f"{r.step_ms:.2f} | - | - | - | - | - | - |"
            )
            continue
        same_ar = (r.batch_size, r.temperature, "ar", r.graphs)
        ar = next(x for x in results if (x.batch_size, x.temperature, x.mode, x.graphs) == same_ar)
        s = r.stage_ms
        lines.append(
            f"| {r.batch_size} | {r.temperature:g} | {r.label} | {'on' if r.graphs else 'off'} | "
            f"{r.tokens_per_s:.1f} | {r.tokens_per_s / hf.tokens_per_s:.2f}x | "
            f"{r.tokens_per_s / ar.tokens_per_s:.2f}x | {r.acceptance_length:.2f} | {r.step_ms:.2f} | "
            f"{s['draft']:.2f} | {s['build']:.2f} | {s['verify']:.2f} | {s['append']:.2f} | "
            f"{s['draft_forward']:.2f}/{s['target_forward']:.2f} | {100 * r.overhead:.0f}% |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r.mode != "hf" and r.graphs == results[-1].graphs]
    scenarios = sorted({(r.batch_size, r.temperature) for r in results})
    labels = list(dict.fromkeys(r.label for r in results))
    fig, (speed_ax, split_ax) = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        values = [
            next(
                (r.tokens_per_s for r in results if r.label == label and (r.batch_size, r.temperature) == sc),
                0.0,
            )
            for sc in scenarios
        ]
        speed_ax.bar([i + j * width for i in range(len(scenarios))], values, width, label=label)
    speed_ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))])
    speed_ax.set_xticklabels([f"batch {b}, T={t:g}" for b, t in scenarios])
    speed_ax.set_ylabel("generated tokens / s")
    speed_ax.set_title(f"throughput ({device})")
    speed_ax.legend(fontsize=8)

    first = [r for r in results if (r.batch_size, r.temperature) == scenarios[0]]
    parts = {
        "draft forward": lambda r: r.stage_ms["draft_forward"],
        "draft other": lambda r: r.stage_ms["draft"] - r.stage_ms["draft_forward"],
        "build": lambda r: r.stage_ms["build"],
        "target forward": lambda r: r.stage_ms["target_forward"],
        "verify other": lambda r: r.stage_ms["verify"] - r.stage_ms["target_forward"],
        "append + schedule": lambda r: r.stage_ms["append"] + r.stage_ms["schedule"],
    }
    bottom = [0.0] * len(first)
    for name, part in parts.items():
        values = [part(r) for r in first]
        split_ax.bar([r.label for r in first], values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    batch, temperature = scenarios[0]
    split_ax.set_ylabel("ms per step")
    split_ax.set_title(f"step time split (batch {batch}, T={temperature:g})")
    split_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="target model directory (default: bundled)")
    parser.add_argument("--drafter", help="drafter directory (default: bundled)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--verify-backend", default="auto", choices=["auto", "torch", "triton", "sgl_kernel"])
    parser.add_argument("--budgets", default="16,32,64", help="ddtree budgets, comma-separated")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=16,
        help="prompts per run (at least the batch size; default %(default)s)",
    )
    parser.add_argument(
        "--tree-builders",
        default="host",
        help="comma-separated: host, device (where the draft lies) (default %(default)s)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds over all configs, interleaved (default %(default)s)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print a torch profiler table of the largest ddtree config at batch 1",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: on a small shared machine more threads contend and "
        "slow small matmuls down by orders of magnitude)",
    )
    parser.add_argument(
        "--graphs",
        default="auto",
        choices=["auto", "on", "off", "both"],
        help="CUDA graphs (off = enforce_eager); auto: both on CUDA, off on CPU (default %(default)s)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"), help="output folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    on_cuda = args.device.startswith("cuda")
    graph_settings = {
        "auto": [on_cuda, False][: 1 + on_cuda],
        "on": [True],
        "off": [False],
        "both": [True, False],
    }
    longest_prompt = 64
    max_seq_len = longest_prompt + args.max_tokens + max(budgets) + 16
    workers = {g: Workers(args, max(batch_sizes), max_seq_len, g) for g in graph_settings[args.graphs]}
    hf = HFBaseline(target_dir(EngineConfig(target=args.target)), args.device, getattr(torch, args.dtype))
    tree_builders = args.tree_builders.split(",")
    configs = [
        (mode, budget, g, tree_builder)
        for g in workers
        for mode, budget in [("ar", 1), ("chain", 1), *(("ddtree", b) for b in budgets)]
        for tree_builder in (tree_builders if mode != "ar" else ["host"])
    ]
    device = torch.cuda.get_device_name() if on_cuda else f"cpu ({torch.get_num_threads()} threads)"
    tokenizer = next(iter(workers.values())).tokenizer

    results: list[Result] = []
    greedy_checks: dict[str, str] = {}
    for batch_size in batch_sizes:
        hf_totals = Totals()
        batch_results: list[Result] = []
        for temperature in temperatures:
            totals = {config: Totals() for config in configs}
            for _ in range(args.rounds):
                if temperature == temperatures[0]:
                    run_hf_once(hf, tokenizer, batch_size, args, hf_totals)
                for config in configs:
                    mode, budget, g, tree_builder = config
                    run_once(
                        workers[g], mode, budget, tree_builder, batch_size, temperature, args, totals[config]
                    )
            for (mode, budget, g, tree_builder), config_totals in totals.items():
                result = summarize(mode, budget, g, tree_builder, batch_size, temperature, config_totals)
                batch_results.append(result)
                print(
                    f"batch {batch_size} T={temperature:g} {result.label:>10} {'graphs' if g else 'eager'}: "
                    f"{result.tokens_per_s:8.1f} tok/s tau {result.acceptance_length:5.2f} "
                    f"step {result.step_ms:6.2f} ms overhead {100 * result.overhead:3.0f}%",
                    flush=True,
                )
                if (mode, temperature) == ("ar", 0.0):
                    same = sum(config_totals.token_ids[i] == t for i, t in hf_totals.token_ids.items())
                    check = f"{same}/{len(hf_totals.token_ids)} prompts"
                    greedy_checks[f"batch {batch_size}, graphs {'on' if g else 'off'}"] = check
                    print(f"  ours ar (greedy) emits HF's greedy tokens on {check}", flush=True)
        hf_result = summarize("hf", 0, False, "host", batch_size, 0.0, hf_totals)
        print(f"batch {batch_size} hf transformers: {hf_result.tokens_per_s:8.1f} tok/s", flush=True)
        results += [hf_result, *batch_results]
    if args.profile:
        profile_steps(next(iter(workers.values())), max(budgets), temperatures[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results, device)
    print("\n" + table)
    (out / "speed.md").write_text(table + "\n")
    (out / "speed.json").write_text(
        json.dumps(
            {
                "device": device,
                "args": vars(args),
                "hf_greedy_match": greedy_checks,
                "results": [asdict(r) for r in results],
            },
            indent=1,
        )
    )
    plot(results, out / "speed.png", device)
    print(f"\nwrote {out / 'speed.md'}, {out / 'speed.json'}, {out / 'speed.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
