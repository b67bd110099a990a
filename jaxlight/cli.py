"""The ``jaxlight`` command line: ``jaxlight plot <metrics.csv | log dir> [--out DIR] [--metrics a b]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxlight`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="jaxlight", description="jaxlight tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plot", help="write PNG plots of the metrics a CSVLogger logged")
    p.add_argument("path", help="a metrics.csv file, or a log directory searched for metrics.csv files")
    p.add_argument("--out", default=None, help="output directory (default: <csv dir>/plots)")
    p.add_argument("--metrics", nargs="+", default=None, help="only these columns (default: all)")
    p.set_defaults(func=_plot)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
