"""The ``lightning-recover`` command line.

Each subcommand lives in the module of its concept; this file only parses arguments and
dispatches, importing lazily so that ``lightning-recover --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_inspect(args: argparse.Namespace) -> int:
    from lightning_recover.checkpoint.tools import inspect_main

    return inspect_main(args)


def _cmd_convert(args: argparse.Namespace) -> int:
    from lightning_recover.checkpoint.tools import convert_main

    return convert_main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "checkpoint":
        from lightning_recover.bench.checkpoint import main as bench_main
    elif args.what in ("recovery", "overhead"):
        from lightning_recover.bench.recovery import main as bench_main
    elif args.what == "resilience":
        from lightning_recover.bench.resilience import main as bench_main
    else:  # pragma: no cover - argparse restricts choices
        raise SystemExit(f"unknown benchmark {args.what!r}")
    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-recover", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="show a checkpoint's index and verify its checksums")
    p.add_argument("checkpoint")
    p.add_argument("--no-verify", action="store_true", help="only print the index, do not read the data")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("convert", help="convert a checkpoint to a plain torch.save file")
    p.add_argument("checkpoint")
    p.add_argument("output")
    p.add_argument("--unsafe-pickle", action="store_true",
                   help="allow arbitrary pickled objects (only for checkpoints you trust)")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("bench", help="benchmarks")
    p.add_argument("what", choices=["checkpoint", "recovery", "overhead", "resilience"])
    p.add_argument("--size-gb", type=float, default=2.0, help="checkpoint benchmark: state size in GB")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--dir", default=None, help="directory to write into (default: a temp dir on /tmp's disk)")
    p.add_argument("--methods", default=None, help="comma-separated subset of methods")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    p.add_argument("--replicas", type=int, default=4, help="recovery/overhead: replicas")
    p.add_argument("--kills", type=int, default=10, help="recovery: number of faults (one run each)")
    p.add_argument("--kind", choices=["kill", "hang"], default="kill", help="recovery: fault kind")
    p.add_argument("--steps", type=int, default=20, help="overhead: steps per run")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0, help="recovery: staleness threshold")
    p.set_defaults(func=_cmd_bench)

    from lightning_recover import launcher

    launcher.add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
