"""`ddtree-serve`: generate text from the command line, or start the Ray Serve application.

    ddtree-serve generate "def fibonacci(n):"             # bundled pair, DDTree, streams text
    echo "def add(a, b):" | ddtree-serve generate --json   # prompt from stdin, one JSON object
    ddtree-serve serve --config deployments/local.yaml     # HTTP + gRPC (needs the [serve] extra)

Bad values exit with code 2 and a one-line message, never a traceback.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import pydantic

from ddtree_serve.config import EngineConfig

MAX_THREADS = 4 * (os.cpu_count() or 1)
"""`--threads` above this is a typo: torch's thread pool fails to start (or crashes) far past it."""

MAX_ERROR_CHARS = 400
"""A load error's message is cut here: a state-dict mismatch lists every key."""

_GENERATE_EXAMPLES = """examples:
  ddtree-serve generate "def fibonacci(n):"
  ddtree-serve generate --mode chain --max-tokens 64 "import numpy as np"
  ddtree-serve generate --temperature 0.8 --top-p 0.95 --seed 1 --json "The quick brown fox"
  ddtree-serve generate --target ~/models/Qwen3-8B --drafter ~/models/Qwen3-8B-DFlash --device cuda \\
      --dtype bfloat16 "Write a haiku about trees."
"""


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-serve",
        description="Speculative decoding with DDTree draft trees over a DFlash drafter.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve}")
    generate = commands.add_parser(
        "generate",
        help="generate a completion for one prompt in this process",
        description="Generate a completion for one prompt (argument or stdin) and stream it to stdout.",
        epilog=_GENERATE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_generate_arguments(generate)
    generate.set_defaults(command_parser=generate)
    serve = commands.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI-compatible) and gRPC with Ray Serve",
        description="Start Ray, deploy the speculation group(s) and serve until Ctrl-C.",
    )
    # The serve arguments come with Ray-side code: import it only when it is the command.
    if list(argv[:1]) == ["serve"]:
        from ddtree_serve.serve.launcher import add_serve_arguments

        add_serve_arguments(serve)
    return parser


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("prompt", nargs="?", help="prompt text; read from stdin when omitted")
    model = parser.add_argument_group("model")
    model.add_argument("--target", help="target model directory (default: the bundled target)")
    model.add_argument("--drafter", help="DFlash drafter directory (default: the bundled drafter)")
    model.add_argument("--device", default=defaults.device, help="cpu, cuda or cuda:N (default: %(default)s)")
    model.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default: %(default)s; small models gain nothing from more, and "
        "on small shared machines extra threads contend and slow every matmul down)",
    )
    model.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=["float32", "bfloat16", "float16"],
        help="(default: %(default)s)",
    )
    model.add_argument(
        "--enforce-eager", action="store_true", help="run every forward eagerly (no CUDA graphs)"
    )
    model.add_argument(
        "--max-seq-len",
        "--max-model-len",
        dest="max_seq_len",
        type=int,
        help="positions for prompt + completion + one draft tree, at most the target's context "
        f"length (default: {defaults.max_seq_len}, capped at that length)",
    )
    spec = parser.add_argument_group("speculation")
    spec.add_argument(
        "--mode",
        default=defaults.mode,
        choices=["ar", "chain", "ddtree"],
        help="ar: plain decoding; chain: linear DFlash draft; ddtree: draft trees (default: %(default)s)",
    )
    spec.add_argument(
        "--budget", type=int, default=defaults.budget, help="DDTree nodes per step (default: %(default)s)"
    )
    spec.add_argument(
        "--budget-policy",
        default=defaults.budget_policy,
        choices=["fixed", "adaptive"],
        help="fixed: every tree gets --budget nodes; adaptive: per step, nodes where they are likely "
        "accepted while predicted tokens/s rise, --budget the ceiling (default: %(default)s)",
    )
    spec.add_argument("--cost-curve", help="adaptive: step-cost JSON file (default: measured at start-up)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens", type=int, default=128, help="tokens to generate (default: %(default)s)"
    )
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    sampling.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (default: %(default)s)"
    )
    sampling.add_argument(
        "--top-k", type=int, default=0, help="keep the k likeliest, 0 = off (default: %(default)s)"
    )
    sampling.add_argument(
        "--seed", type=int, help="seed for reproducible sampling (default: none, a fresh draw each run)"
    )
    sampling.add_argument(
        "--stop", action="append", default=[], help="stop string, repeatable (default: none)"
    )
    sampling.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-text")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from ddtree_serve.serve.launcher import run_serve

        return run_serve(args)
    try:
        return run_generate(args.command_parser, args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130  # as a shell reports a command stopped by Ctrl-C
    except BrokenPipeError:
        # The reader went away (`| head`): say nothing more, as other command-line tools do, and
        # keep Python's own flush at exit from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def run_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    # Imported here so `--help` and argument errors stay instant (no torch import).
    import torch

    from ddtree_serve.engine.llm import LLM
    from ddtree_serve.engine.sampling_params import SamplingParams

    prompt = _prompt(parser, args.prompt)
    try:
        config = EngineConfig(
            target=args.target,
            drafter=args.drafter,
            device=args.device,
            dtype=args.dtype,
            mode=args.mode,
            budget=args.budget,
            budget_policy=args.budget_policy,
            cost_curve=args.cost_curve,
            max_num_seqs=1,
            enforce_eager=args.enforce_eager,
            **({} if args.max_seq_len is None else {"max_seq_len": args.max_seq_len}),
        )
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
    except (pydantic.ValidationError, ValueError) as error:
        parser.error(one_line_error(error))
    if problem := config.missing_model_dir():
        parser.error(f"--{problem}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    if not 1 <= args.threads <= MAX_THREADS:
        parser.error(f"--threads must be in [1, {MAX_THREADS}], got {args.threads}")
    if args.cost_curve is not None:
        if args.budget_policy != "adaptive":
            parser.error("--cost-curve prices the adaptive budget's steps: pass --budget-policy adaptive")
        if problem := cost_curve_problem(args.cost_curve):
            parser.error(f"--cost-curve {args.cost_curve}: {problem}")
    torch.set_num_threads(args.threads)

    try:
        llm = LLM.from_config(config)
    except Exception as error:  # any file that does not load is a one-line answer
        models = f"target {config.target or 'bundled'}"
        if config.mode != "ar":
            models += f", drafter {config.drafter or 'bundled'}"
        problem = _load_error(error)
        parser.exit(2, f"ddtree-serve generate: error: the models did not load ({models}): {problem}\n")
    try:
        start = time.perf_counter()
        final = _stream(llm, prompt, params, echo=not args.json)
        seconds = time.perf_counter() - start
    except (ValueError, RuntimeError) as error:
        parser.exit(2, f"ddtree-serve generate: error: {one_line_error(error)}\n")
    stats: dict[str, Any] = {**final.stats.as_dict(), "finish_reason": final.finish_reason}
    stats["tokens_per_second"] = len(final.token_ids) / seconds if seconds > 0 else 0.0
    if args.json:
        print(json.dumps({"text": final.text, "token_ids": final.token_ids, "stats": stats}))
    else:
        print(
            f"\n[{len(final.token_ids)} tokens, {final.stats.steps} steps, "
            f"acceptance length {final.stats.acceptance_length:.2f}, "
            f"{stats['tokens_per_second']:.1f} tokens/s, {args.mode}]",
            file=sys.stderr,
        )
    return 0


def _prompt(parser: argparse.ArgumentParser, argument: str | None) -> str:
    """The prompt argument, else stdin, as UTF-8 text (the tokenizer takes nothing else)."""
    if argument is None:
        try:
            argument = sys.stdin.read()
        except UnicodeDecodeError:
            parser.error(f"the prompt on stdin is not {sys.stdin.encoding} text")
    try:
        argument.encode("utf-8")  # bytes that are not UTF-8 arrive as surrogates (POSIX locale, argv)
    except UnicodeEncodeError as error:
        parser.error(f"the prompt is not UTF-8 text (character {error.start})")
    if not argument.strip():
        parser.error("the prompt is empty (pass it as an argument or on stdin)")
    return argument


def cost_curve_problem(path: str) -> str | None:
    """What keeps the cost-curve file at `path` from loading, in one line (None: it loads)."""
    from ddtree_serve.engine.budget import load_cost_curve

    try:
        load_cost_curve(path)
    except Exception as error:  # a file of any shape: JSON, OS and format errors
        return _load_error(error)
    return None


def _load_error(error: BaseException) -> str:
    """A loader's exception as one line: the file it names (when it does) and its message, its
    lines joined (torch's state-dict report spreads one mismatch over several)."""
    if isinstance(error, FileNotFoundError | IsADirectoryError | PermissionError) and error.filename:
        return f"{error.filename}: {error.strerror}"
    lines = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if len(lines) > MAX_ERROR_CHARS:
        lines = lines[: MAX_ERROR_CHARS - 3] + "..."
    if isinstance(error, KeyError | TypeError | AttributeError | IndexError):
        # A config or checkpoint missing what the model needs: the type says more than the key.
        return f"{type(error).__name__}: {lines}" if lines else type(error).__name__
    return lines or type(error).__name__


def _stream(llm: Any, prompt: str, params: Any, echo: bool) -> Any:
    """Step the engine, writing each new piece of text as soon as it is final; the last output."""
    from ddtree_serve.engine.outputs import Detokenizer

    engine = llm.engine
    engine.add_request("cli", prompt, params)
    detokenizer = Detokenizer(engine.tokenizer, params.stop)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = detokenizer.update(output)
            if echo and final.delta_text:
                sys.stdout.write(final.delta_text)
                sys.stdout.flush()
    assert final is not None and final.finished
    return final


def one_line_error(error: Exception) -> str:
    """Pydantic's multi-line report (or any message) as one line a terminal user can act on."""
    if isinstance(error, pydantic.ValidationError):
        return "; ".join(_one_error(e["loc"], e["msg"]) for e in error.errors())
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _one_error(loc: tuple[int | str, ...], message: str) -> str:
    """`field.path: message`, without pydantic's "Value error, " (a validator's own message says
    what is wrong) and without a path where the whole model was checked (the message names the
    fields)."""
    message = message.removeprefix("Value error, ")
    path = ".".join(str(part) for part in loc)
    return f"{path}: {message}" if path else message


if __name__ == "__main__":
    sys.exit(main())
