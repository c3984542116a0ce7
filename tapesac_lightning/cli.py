"""The ``tapesac`` console script.

``tapesac launch``: Accelerate's own launcher, taking exactly ``accelerate launch``'s arguments,
with TapeSAC's ``tapesac_*`` keys taken out of the config YAML and carried to the workers.
``tapesac report RUN_OR_CHECKPOINT``: a finished run's plans, speedups and peaks, and figures.
``tapesac bench ...``: the frontier harness of a source checkout, ``python -m benchmarks.frontier``
(TapeSAC against every baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tapesac_core import TapeSACError

from . import needs_extra


def launch(args: argparse.Namespace) -> None:
    """Validate and export the ``tapesac_*`` settings, then run ``accelerate launch`` on the rest.
    Accelerate parses the arguments here, not in ``parser()``, so that the other commands run
    without it."""
    with needs_extra("accelerate", "tapesac launch", "yaml"):
        import yaml
        from accelerate.commands.config import default_config_file
        from accelerate.commands.launch import launch_command, launch_command_parser

        from ._compat import mark_cpu_workers, use_config_file
        from .accelerate import SETTINGS_ENV, TapeSACPlugin, check_fsdp2, split_config
    # Accelerate's parser class: its actions record which options were given, which its launcher
    # reads to decide what the config file fills in.
    accelerate_parser = launch_command_parser()
    accelerate_parser.prog = "tapesac launch"
    accelerate_parser.description = (
        "Accelerate's `accelerate launch` (same arguments), with the "
        "tapesac_* keys of the config's fsdp_config carried to the workers"
    )
    args = accelerate_parser.parse_args(args.args)
    path = args.config_file or default_config_file
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    rest, ours = split_config(config)
    if ours:
        TapeSACPlugin.from_keys(ours)  # fails here, before any worker starts
        check_fsdp2(rest)
        os.environ[SETTINGS_ENV] = json.dumps(ours)
    else:
        os.environ.pop(SETTINGS_ENV, None)
    if rest.get("use_cpu"):
        mark_cpu_workers()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as tmp:
        yaml.safe_dump(rest, tmp)
    try:
        use_config_file(args, tmp.name)  # the config without TapeSAC's keys
        launch_command(args)
    finally:
        os.unlink(tmp.name)


def report(args: argparse.Namespace) -> None:
    """Print a run's report (or its JSON) and write its figures under ``--out``."""
    from tapesac_core.report.report import read_run

    run = read_run(args.run)
    print(json.dumps(run.to_json(), indent=1) if args.json else run.text())
    if args.out is None:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in run.figures().items():
        figure.savefig(out / name)
        written.append(out / name)
    if run.frontier_png is not None:
        (out / "frontier.png").write_bytes(run.frontier_png)
        written.append(out / "frontier.png")
    if not args.json:
        print("figures: " + ", ".join(map(str, written)))


def bench(args: argparse.Namespace) -> None:
    """Run the frontier harness (``python -m benchmarks.frontier``) with the remaining arguments.
    It needs the benchmarks and example models of a source checkout (they are not installed): the
    current directory's, else the checkout this package is installed from (editable install)."""
    import importlib

    roots = (Path.cwd(), Path(__file__).resolve().parents[1])
    root = next((r for r in roots if (r / "benchmarks" / "frontier.py").is_file()), None)
    if root is None:
        raise TapeSACError(
            "benchmarks/frontier.py not found. Fix: run `tapesac bench` from a "
            "TapeSAC source checkout"
        )
    # The checkout's packages (benchmarks, examples) import from it, as under `python -m`.
    if sys.path[:1] != [str(root)]:
        sys.path.insert(0, str(root))
    module = importlib.import_module("benchmarks.frontier")
    module.main(args.args, prog="tapesac bench")


def parser() -> argparse.ArgumentParser:
    """``tapesac`` and its subcommands."""
    p = argparse.ArgumentParser(prog="tapesac", description="TapeSAC command line")
    commands = p.add_subparsers(dest="command", required=True)
    launch_parser = commands.add_parser(
        "launch",
        help="Accelerate's launcher, with the tapesac_* config keys carried to the workers",
        # Every argument goes to Accelerate's launch parser (its --help too): no option of this
        # parser may claim a "-" one.
        add_help=False,
        prefix_chars="+",
    )
    launch_parser.add_argument("args", nargs=argparse.REMAINDER)
    launch_parser.set_defaults(func=launch)
    report_parser = commands.add_parser(
        "report",
        help="a finished run's plans, predicted vs measured speedups and peaks",
        description="Read a TensorBoard run folder, a Lightning checkpoint or an Accelerate "
        "save_state folder; print each plan's table, predicted vs measured speedups "
        "and peaks; write figures with --out.",
    )
    report_parser.add_argument(
        "run", help="TensorBoard folder, Lightning checkpoint, or Accelerate save_state folder"
    )
    report_parser.add_argument("--out", default=None, help="write the figures (PNG) here")
    report_parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    report_parser.set_defaults(func=report)
    bench_parser = commands.add_parser(
        "bench",
        help="TapeSAC against every checkpointing baseline at equal memory",
        description="python -m benchmarks.frontier (from a source checkout): table, JSON and plots; "
        "`tapesac bench --help` lists its options.",
        # Every argument goes to the harness: no option of this parser may claim a "-" one.
        add_help=False,
        prefix_chars="+",
    )
    bench_parser.add_argument("args", nargs=argparse.REMAINDER)
    bench_parser.set_defaults(func=bench)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``tapesac`` console script."""
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except TapeSACError as e:
        sys.exit(f"tapesac {args.command}: {e}")


if __name__ == "__main__":
    main()
