"""The `autotune` command line: `autotune demo`, `autotune monitor`, `autotune policies`, `autotune report`.

Errors a user can fix (a bad preset, an unknown device) are printed as one clear line
with exit code 2, not as a traceback.

Owns: the `autotune` command's arguments and its words on stderr. Touches: what each subcommand runs.
"""

from __future__ import annotations

import argparse
import sys

from loguru import logger
from tqdm import tqdm

from autotune.common import notices


def _cmd_demo(args: argparse.Namespace) -> int:
    from autotune.common.oom import OutOfMemory  # imports torch: only the commands that train need it
    from autotune.demo import run_demo

    try:
        return run_demo(args)
    except OutOfMemory as exc:
        print(f"autotune demo: error: {exc}", file=sys.stderr)
        return 2


def _cmd_monitor(args: argparse.Namespace) -> int:
    from autotune.monitor.daemon import run_daemon

    return run_daemon(args)


def _cmd_policies(args: argparse.Namespace) -> int:
    import inspect

    from autotune.tuning.presets import installed_policies, policy_parameters, preset_names, resolve_policies

    if args.check:
        policies = resolve_policies(args.check)
        print(f"{args.check}: OK ({', '.join(p.name for p in policies) or 'no policies'})")
        return 0
    for name, cls in sorted(installed_policies().items()):
        cls = cls if isinstance(cls, type) else cls.load()
        summary = (inspect.getdoc(cls) or "").splitlines()[0] if inspect.getdoc(cls) else ""
        print(f"{name}: {summary}")
        for param, default in policy_parameters(cls).items():
            print(f"    {param} = {default!r}")
    print(f"\npresets: {', '.join(preset_names())}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    import json

    from autotune.observe.report import render, summarize

    summary = summarize(args.run_dir)
    print(json.dumps(summary, indent=2, default=str) if args.json else render(summary))
    if args.plot is not None:
        from pathlib import Path

        from autotune.observe.report_plot import plot_timeline

        out = Path(args.plot) if args.plot else Path(args.run_dir) / "timeline.png"
        plot_timeline(args.run_dir, out)
        sys.stdout.flush()  # the summary first, then where the plot went
        print(f"timeline: {out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from autotune.demo import add_arguments as add_demo_arguments
    from autotune.monitor.daemon import add_arguments as add_monitor_arguments

    parser = argparse.ArgumentParser(prog="autotune", description="Keep PyTorch training alive under memory limits.")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a torchvision model under a memory cap that forces OOMs")
    add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)
    monitor = sub.add_parser("monitor", help="watch GPU (or host) memory: live view, JSONL, Prometheus")
    add_monitor_arguments(monitor)
    monitor.set_defaults(func=_cmd_monitor)
    policies = sub.add_parser("policies", help="list the available policies and presets")
    policies.add_argument("--check", metavar="FILE.toml", help="validate a preset file")
    policies.set_defaults(func=_cmd_policies)
    report = sub.add_parser("report", help="what a run did and why: OOMs, actions, cache, reliefs, memory")
    report.add_argument("run_dir", help="a run directory (it holds events.jsonl)")
    report.add_argument("--json", action="store_true", help="the summary as JSON, for scripts")
    report.add_argument("--plot", nargs="?", const="", metavar="FILE.png",
                        help="draw the memory timeline (default RUN_DIR/timeline.png)")
    report.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logger.remove()
    # Through tqdm.write so log lines do not tear the progress bar.
    logger.add(lambda message: tqdm.write(message, end="", file=sys.stderr), colorize=sys.stderr.isatty(),
               level="WARNING" if args.quiet else "INFO",
               format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
    logger.enable("autotune")
    notices.show_through_loguru()  # the warnings too, once, in this sink's format
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"autotune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"autotune {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
