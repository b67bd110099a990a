"""The ``jaxlight`` console script: ``jaxlight plot``, ``jaxlight launch``, ``jaxlight verify``.

:func:`main` runs the tools in :data:`COMMANDS`: ``jaxlight plot`` (PNG plots
of a CSVLogger's metrics), ``jaxlight launch`` (one script as N local
processes of one multi-process run, see :mod:`jaxlight.launch`) and
``jaxlight verify`` (each strategy against one device, see
:mod:`jaxlight.verify`). Each tool is imported only when its command runs, so
``jaxlight --help`` starts no JAX backend.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable, Sequence

__all__ = ["COMMANDS", "main"]


def _plot(args: argparse.Namespace) -> int:
    from jaxlight.plot import plot_metrics

    try:
        paths = plot_metrics(args.path, out_dir=args.out, metrics=args.metrics)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxlight plot: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def _plot_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="write PNG plots of the metrics a CSVLogger logged")
    p.add_argument("path", help="a metrics.csv file, or a log directory searched for metrics.csv files")
    p.add_argument("--out", default=None, help="output directory (default: <csv dir>/plots)")
    p.add_argument("--metrics", nargs="+", default=None, help="only these columns (default: all)")
    p.set_defaults(func=_plot)


def _launch_command(sub: argparse._SubParsersAction) -> None:
    from jaxlight import launch

    p = sub.add_parser(
        "launch",
        help="run a script as N local processes of one multi-process JAX run",
        description=textwrap.fill(launch.DESCRIPTION, 88),
        epilog=launch.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_arguments(p)
    p.set_defaults(func=launch.run_from_args)


def _verify(args: argparse.Namespace) -> int:
    if args.devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # CPU has one device unless told before JAX starts its backends (nothing has started them yet);
        # the flag only shapes the host platform, so it is harmless where an accelerator is used
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import functools
    import json

    from jaxlight.errors import MisconfigurationError
    from jaxlight.verify import load_object, verify

    try:
        module_class = load_object(args.module)
        datamodule = load_object(args.datamodule)() if args.datamodule else None
        model_args = json.loads(args.model_args) if args.model_args else {}
        if not isinstance(model_args, dict):
            raise ValueError(f"--model-args must be a JSON object, got {args.model_args!r}")
    except (ValueError, ImportError, OSError) as e:
        print(f"jaxlight verify: {e}", file=sys.stderr)
        return 2
    make = functools.partial(module_class, **model_args)
    functools.update_wrapper(make, module_class, assigned=("__name__", "__qualname__"), updated=())
    try:
        report = verify(
            make,
            datamodule=datamodule,
            strategies=args.strategies,
            devices=args.devices,
            steps=args.steps,
            lr=args.lr,
            momentum=args.momentum,
            trainer_kwargs={"precision": args.precision},
        )
    except (MisconfigurationError, ValueError, TypeError) as e:
        print(f"jaxlight verify: {e}", file=sys.stderr)
        return 2
    return 0 if report.ok else 1


def _verify_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check that each strategy trains a module as one device does",
        description="Train a LightningModule for a few steps on one device and under each strategy, on the same "
        "batches, and print one table: the largest differences of losses, step-1 gradients and parameters "
        "(with the tolerances and why), bytes per device, the collectives in the compiled step and the compile "
        "time. Exits 1 when a strategy differs beyond tolerance, naming the leaves that differ most; 2 on bad "
        "input. See docs/verify.md.",
    )
    p.add_argument(
        "module",
        help="path/to/file.py:ModuleClass (or package.module:ModuleClass); built with no arguments unless --model-args",
    )
    p.add_argument(
        "--datamodule", default=None, help="path/to/file.py:DataModuleClass; default: the module's train_dataloader()"
    )
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategy names, e.g. ddp,fsdp,fsdp+tp (default: every built-in one)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices per strategy (default: all local devices; on CPU this many simulated devices are created)",
    )
    p.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    p.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate of the comparison (default 0.01)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum of the comparison (default 0.9)")
    p.add_argument("--precision", default="32-true", help="Trainer precision of every run (default 32-true)")
    p.add_argument(
        "--model-args", default=None, help="JSON object of keyword arguments for the module, e.g. '{\"hidden\": 64}'"
    )
    p.set_defaults(func=_verify)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_plot_command, _launch_command, _verify_command]
"""The ``jaxlight`` subcommands. Each entry adds one parser to the subparsers it is given and sets
``func``: a function of the parsed arguments that returns the exit status. Add a command by
appending one such function."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxlight`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="jaxlight", description="jaxlight tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    return args.func(args)
