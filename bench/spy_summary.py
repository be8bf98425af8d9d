"""Summarise a `py-spy record --format raw --threads` profile: samples per (process, thread),
and the functions each spent its samples in (own time, the stack's innermost frame) and passed
through (inclusive). With `--subprocesses` a stack starts with its chain of processes; it is
counted under the innermost (a Ray worker shows its process title, e.g. `ray::ServeReplica:...`).

`--inside FUNCTION` keeps only the samples taken inside that function (e.g. the engine's step,
leaving out the idle loop around it) and counts their frames below it: where a served step's
time goes.

    py-spy record -p PID -d 20 --threads --gil --format raw -o gil.txt
    py-spy record --subprocesses --threads --gil --nonblocking --format raw -o gil.txt -- python ...
    python bench/spy_summary.py gil.txt --top 15 --process Coordinator
    python bench/spy_summary.py all.txt --inside ObservedEngine.step   # with --idle samples
"""

import argparse
import collections
import re


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("profile", help="py-spy raw output (one 'frame;frame;... count' line a stack)")
    parser.add_argument("--top", type=int, default=15, help="functions per thread (default: %(default)s)")
    parser.add_argument("--process", help="only processes whose command line holds this text")
    parser.add_argument(
        "--with-thread", help="only processes with a thread of this name (e.g. ddtree-engine)"
    )
    parser.add_argument("--min-share", type=float, default=0.02, help="threads below this share are left out")
    parser.add_argument("--inside", help="only samples inside this function, counted from below it")
    args = parser.parse_args(argv)
    by_thread: dict[str, int] = collections.Counter()
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    through: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    with open(args.profile, encoding="utf-8") as lines:
        stacks = lines.readlines()
    if args.with_thread:
        wanted = {line.split(";thread ")[0] for line in stacks if f"): {args.with_thread};" in line}
        stacks = [line for line in stacks if line.split(";thread ")[0] in wanted]
    for line in stacks:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        processes = [i for i, frame in enumerate(frames) if frame.startswith("process ")]
        process = frames[processes[-1]] if processes else ""
        if args.process and args.process not in process:
            continue
        frames = frames[processes[-1] + 1 :] if processes else frames
        name = frames[0] if frames and frames[0].startswith("thread") else "?"
        thread = f"{_short(process)} {re.sub(r' [0-9]+$', '', name)}"
        if args.inside:
            inside = [i for i, frame in enumerate(frames) if args.inside in frame]
            if not inside:
                continue
            frames = [name, *frames[inside[-1] + 1 :]]
            if len(frames) == 1:
                frames.append(f"(in {args.inside} itself)")
        total += count
        by_thread[thread] += count
        own[thread][frames[-1]] += count
        for frame in set(frames[1:]):
            through[thread][frame] += count
    print(f"{total} samples")
    for thread, count in sorted(by_thread.items(), key=lambda item: -item[1]):
        if count < args.min_share * total:
            continue
        print(f"\n## {thread}: {count} samples ({count / total:.0%})")
        print("own:")
        for frame, frame_count in own[thread].most_common(args.top):
            print(f"  {frame_count:6d} {frame_count / count:5.0%}  {frame}")
        print("through:")
        for frame, frame_count in through[thread].most_common(args.top):
            print(f"  {frame_count:6d} {frame_count / count:5.0%}  {frame}")


def _short(process: str) -> str:
    """`process PID:"command line"` -> `PID:command` (its first word, 60 characters at most)."""
    match = re.match(r'process (\d+):"([^"]*)"', process)
    return "" if match is None else f"{match.group(1)}:{match.group(2).split(' ')[0][:60]}"


if __name__ == "__main__":
    main()
