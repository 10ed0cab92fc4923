"""The ``lightning-recover`` command line.

Each subcommand lives in the module of its concept; this file only parses arguments and
dispatches, importing lazily so that ``lightning-recover --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, NoReturn

from lightning_recover.observe.logs import configure_logging


def _cmd_inspect(args: argparse.Namespace) -> int:
    from lightning_recover.checkpoint.tools import inspect_main

    return inspect_main(args)


def _cmd_convert(args: argparse.Namespace) -> int:
    from lightning_recover.checkpoint.tools import convert_main

    return convert_main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    name = _BENCH_MODULES[args.what]
    if args.what == "checkpoint" and getattr(args, "ranks", None):
        name = "dcp_ranks"  # sharded DCP save by N processes
        if args.size_gb is None:
            args.size_gb = 2.0
    module = importlib.import_module(f"lightning_recover.bench.{name}")
    return int(module.main(args) or 0)


def _cmd_demo(args: argparse.Namespace) -> int:
    from lightning_recover.demo import main as demo_main

    return demo_main(args)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from lightning_recover.simulate import main as simulate_main

    return simulate_main(args)


_BENCH_MODULES = {
    "checkpoint": "checkpoint",
    "async": "async_checkpoint",
    "recovery": "recovery",
    "overhead": "recovery",
    "resilience": "resilience",
    "scale": "scale",
}


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help=COMMANDS["bench"])
    kinds = bench.add_subparsers(dest="what", required=True)
    _add_bench_checkpoint(kinds)

    p = kinds.add_parser("async", help="time blocked per checkpoint and time to durability vs async peers")
    from lightning_recover.bench.async_checkpoint import build_parser as async_parser

    async_parser(p)
    p.set_defaults(func=_cmd_bench)

    p = kinds.add_parser(
        "scale",
        help="the control plane against the job's size: N replicas (threads of worker processes), N = 16 ... 512",
    )
    from lightning_recover.bench.scale import build_parser as scale_parser

    scale_parser(p)
    p.set_defaults(func=_cmd_bench)

    p = kinds.add_parser("recovery", help="fault -> survivors' next committed step, over many faults")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kills", type=int, default=10, help="number of faults (one run each)")
    p.add_argument("--kind", choices=["kill", "hang"], default="kill")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    _add_bench_output(p)

    p = kinds.add_parser("overhead", help="failure-free step time vs Lightning's strategy='ddp'")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument(
        "--baseline",
        default=None,
        help="another checkout of lightning-recover (e.g. a git worktree of an older commit) to run "
        "as a third mode: the before/after of a change in one run",
    )
    _add_bench_output(p)
    _add_bench_resilience(kinds)


def _add_bench_output(p: argparse.ArgumentParser) -> None:
    """The options of where a bench works and writes (those whose module has no parser of its own)."""
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    p.set_defaults(func=_cmd_bench)


def _add_bench_checkpoint(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "checkpoint", help="durable save and cold load vs Lightning, torch.save, DCP, safetensors, fio"
    )
    p.add_argument("--size-gb", type=float, default=None, help="state size in GB (default: 2, for --state small10k 1)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--methods", default=None, help="comma-separated subset of methods")
    p.add_argument(
        "--state",
        default="gpt",
        choices=["gpt", "llama", "small10k"],
        help="gpt: GPT-2-like fp32 + AdamW; llama: bf16 params + fp32 master/Adam moments + norm/rope vectors; "
        "small10k: 10,000 tensors (64 layers of large matrices plus norms, biases, scales)",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="pair every run of each method (default: uring) with a fio run of the same bytes next to it "
        "and report the median of the paired ratios and their spread",
    )
    p.add_argument(
        "--fio-iodepth",
        default=None,
        help="with --paired: fio's --iodepth, one or a comma-separated list, the best per pair (default 1,4,16)",
    )
    p.add_argument(
        "--ranks",
        default=None,
        help="e.g. 1,2,4: instead, a sharded DCP save by N processes (UringStorageWriter vs FileSystemWriter "
        "thread_count 1 and 4 vs fio numjobs=N), for each N",
    )
    p.add_argument("--small", type=int, default=2048, help="with --ranks: small tensors per rank (0: skip)")
    p.add_argument(
        "--plan-cache",
        action="store_true",
        help="with --ranks: every writer reuses the last save's plan, as a training loop's saves would",
    )
    _add_bench_output(p)


def _add_bench_resilience(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("resilience", help="this project vs checkpoint-and-restart vs failure-free")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="steps (20 = the module's own default schedule)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of modes (recover-norestart, recover-standby, failure-free-standby: only when "
        "asked for)",
    )
    p.add_argument(
        "--straggler",
        default=None,
        metavar="R:F[@S]",
        help="straggler scenario instead of faults: replica R's microbatches take F times as long (from step S "
        "on); compares recover-equal, recover-throughput, ddp-torch and failure-free",
    )
    p.add_argument("--microbatches", type=int, default=None, help="M per step (default 12)")
    p.add_argument("--standby", type=int, default=1, help="warm standbys of the recover-standby modes (default 1)")
    p.add_argument(
        "--replica-size",
        type=int,
        default=1,
        help="K > 1: sharded replicas of K processes, against stock HSDP with DCP checkpoints",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="seconds (default 5, safe on a loaded 2-core machine)",
    )
    _add_bench_output(p)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it says something: not for flags, unset (None) values, or a help
    text that names its default already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", argparse.SUPPRESS)
        if unset or "default" in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help shows defaults and whose errors are one line with a HINT;
    subcommands' parsers are of the same class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 and one line (no usage block: the line names the option and the fix)."""
        option = re.match(r"argument (\S+): (.*)", message)
        if option and option.group(2).startswith(option.group(1).split("/")[-1]):
            message = option.group(2)  # the option's own check names it already
        tail = "" if "HINT:" in message else f". HINT: see `{self.prog} --help`"
        self.exit(2, f"{self.prog}: error: {message.rstrip('.')}{tail}\n")


DESCRIPTION = (
    "lightning-recover: data-parallel training with Lightning that survives dead and hung replicas, "
    "and checkpoints at the speed of the disk. Run `lightning-recover COMMAND --help` for a command's options."
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning-recover")
    except PackageNotFoundError:  # run from a checkout that was never installed
        import lightning_recover

        return lightning_recover.__version__


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help=COMMANDS["inspect"],
        description="Show what a checkpoint holds (tensors, dtypes, shapes, offsets) and verify its checksums. "
        "Exit code 0: OK; 1: damaged data; 2: not a readable checkpoint; 4: intact data under a wrong recorded "
        "checksum (lazy saves before the CRC combine fix).",
    )
    p.add_argument("checkpoint", help="a checkpoint file (.ckpt, .pt) or a sharded (DCP) checkpoint directory")
    p.add_argument("--no-verify", action="store_true", help="only print the index, do not read the data")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help=COMMANDS["convert"], description="Convert a checkpoint to a plain torch.save file."
    )
    p.add_argument("checkpoint", help="the checkpoint to read")
    p.add_argument("output", help="the torch.save file to write")
    p.add_argument(
        "--unsafe-pickle", action="store_true", help="allow arbitrary pickled objects (only for checkpoints you trust)"
    )
    p.set_defaults(func=_cmd_convert)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from lightning_recover import demo

    p = sub.add_parser(
        "demo",
        help=COMMANDS["demo"],
        description="Train a small GPT with 4 replicas on CPU, kill one and hang another mid-run, then compare "
        "with a failure-free replay of the same steps (OUT/summary.json, OUT/demo.png).",
    )
    demo.add_arguments(p)
    p.set_defaults(func=_cmd_demo)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from lightning_recover import simulate

    p = sub.add_parser(
        "simulate",
        help=COMMANDS["simulate"],
        description="Project effective throughput to large clusters with a discrete-event model (docs/simulator.md).",
    )
    simulate.add_arguments(p)
    p.set_defaults(func=_cmd_simulate)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    from lightning_recover.launch import commands

    commands.add_subcommands(sub)


def _cmd_status(args: argparse.Namespace) -> int:
    from lightning_recover.observe.terminal import status_main

    return status_main(args)


def _add_status(sub: argparse._SubParsersAction) -> None:
    from lightning_recover.observe import terminal

    p = sub.add_parser(
        "status",
        help=COMMANDS["status"],
        description="Print a running job's state: from the status address its monitor serves (--status-address of "
        "run, torchrun and coordinator), or read straight from its control plane.",
        epilog="examples: lightning-recover status 127.0.0.1:9400; lightning-recover status --control-plane "
        "etcd://10.0.0.5:2379 --job train-7",
    )
    terminal.add_arguments(p)
    p.set_defaults(func=_cmd_status)


def _add_etcd(sub: argparse._SubParsersAction) -> None:
    from lightning_recover.control_plane import etcd_cluster

    etcd_cluster.add_subcommands(sub)


def _add_leave(sub: argparse._SubParsersAction) -> None:
    from lightning_recover.launch import elastic_commands

    elastic_commands.add_leave_subcommand(sub, COMMANDS["leave"])


def _add_fork_server(sub: argparse._SubParsersAction) -> None:
    from lightning_recover.launch import warm_fork_server

    warm_fork_server.add_subcommand(sub, COMMANDS["fork-server"])


def _add_watch_relay(sub: argparse._SubParsersAction) -> None:
    from lightning_recover.launch import relay_command

    relay_command.add_subcommand(sub, COMMANDS["watch-relay"])


def _add_slurm(sub: argparse._SubParsersAction) -> None:
    from lightning_recover.launch import slurm

    slurm.add_subcommand(sub)


#: Every command and its line in ``lightning-recover --help`` (a test checks that each command's own
#: parser says the same).
COMMANDS = {
    "inspect": "show a checkpoint's index and verify its checksums",
    "convert": "convert a checkpoint to a plain torch.save file",
    "bench": "benchmarks (each compares against its peers in the same run)",
    "demo": "resilient training of a small GPT with injected failures (the main job)",
    "simulate": "project effective throughput to large clusters (discrete-event model)",
    "run": "run a script once per replica under a tolerant launcher",
    "torchrun": "one torchrun job per replica (restarts stay inside a replica)",
    "coordinator": "run only the coordinator (multi-node jobs)",
    "leave": "ask a running replica to leave at its next step boundary (a preemption notice from outside)",
    "status": "a running job's replicas, steps and recoveries (from its status address or control plane)",
    "etcd": "a local 3-member etcd cluster with TLS client certificates (tests, trying it out)",
    "slurm": "inside a Slurm batch job: the coordinator here, one replica per node (srun)",
    "fork-server": "keep torch and Lightning imported for the jobs started on this host",
    "watch-relay": "serve the job's etcd keys to other hosts' relays (one watch of etcd per rack)",
}
_ADDERS = {
    "inspect": _add_inspect,
    "convert": _add_convert,
    "bench": _add_bench,
    "demo": _add_demo,
    "simulate": _add_simulate,
    "run": _add_launch,  # run, torchrun and coordinator are added together
    "torchrun": _add_launch,
    "coordinator": _add_launch,
    "leave": _add_leave,
    "status": _add_status,
    "etcd": _add_etcd,
    "slurm": _add_slurm,
    "fork-server": _add_fork_server,
    "watch-relay": _add_watch_relay,
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser.

    Args:
        argv: the arguments about to be parsed. Only the command they name gets its full parser, so that only
            its modules are imported (torch costs seconds that ``--help``, ``--version`` or ``simulate`` do
            not need); the other commands are listed with their help line. None: every command in full.

    Returns:
        The parser.
    """
    parser = Parser(prog="lightning-recover", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    for name, help_line in COMMANDS.items():
        if name in sub.choices:  # added with its group
            continue
        if argv is None or _ADDERS[name] is _ADDERS.get(named):  # the named command's group, in full
            _ADDERS[name](sub)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    configure_logging()  # the package's log lines, as "[lightning-recover] ..." on stderr
    if getattr(args, "check", None) is not None:  # checks that involve several options
        args.check(args)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader went away (`lightning-recover inspect ... | head`): not an error of ours. Point stdout at
        # /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
