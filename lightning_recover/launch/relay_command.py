"""``lightning-recover watch-relay``: a watch relay that the hosts' relays follow over TCP (one per rack, say), so
that etcd sends each change of the job's keys once per such relay instead of once per host
(``control_plane/watch_relay.py``; docs/control_plane.md, "Thousands of replicas"). Launchers follow it with
``--watch-upstream HOST:PORT``; a relay may itself follow another with ``--upstream``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Optional

from lightning_recover import env
from lightning_recover.control_plane import config
from lightning_recover.control_plane.watch_relay import WatchRelay
from lightning_recover.errors import RecoverError
from lightning_recover.launch.control_plane_options import add_job_arguments, job_arguments
from lightning_recover.observe.address import parse_address
from lightning_recover.protocol.messages import JobSecret

#: How the command announces where it serves (the line :func:`served_address` reads back).
ANNOUNCEMENT = "watch relay on {host}:{port}, following {source}"


def served_address(output: str) -> Optional[tuple[str, int]]:
    """Where a ``watch-relay`` process serves, read from its output (None before it announced it)."""
    _, sep, rest = output.partition("watch relay on ")
    if not sep or ", following " not in rest:
        return None
    host, _, port = rest.split(", following ", 1)[0].rpartition(":")
    return host, int(port)


def start_relay(args: argparse.Namespace) -> WatchRelay:
    """The relay the command line describes, serving."""
    settings, secret_file = job_arguments(args)
    if settings is None or not settings.job or not secret_file:
        raise ValueError(
            "watch-relay: name the job's etcd, the job and its secret. HINT: --control-plane etcd://HOST:PORT "
            f"--job NAME --secret-file FILE (or {env.CONTROL_PLANE}, {env.JOB} and {env.SECRET_FILE}), as its "
            "launchers were given"
        )
    listen = parse_address(args.listen, "watch relay address", "--listen")
    upstream = parse_address(args.upstream, "upstream relay address", "--upstream") if args.upstream else None
    settings = config.with_job(settings, args.job)
    return WatchRelay(
        settings.client(),
        settings.watched_prefix.encode(),
        listen=listen,
        upstream=upstream,
        secret_key=JobSecret.from_file(secret_file).key,
        say=lambda line: print(f"[lightning-recover] {line}", file=sys.stderr, flush=True),
    ).start()


def _cmd_watch_relay(args: argparse.Namespace) -> int:
    try:
        relay = start_relay(args)
    except (ValueError, OSError, RecoverError) as exc:
        raise SystemExit(f"lightning-recover {exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    assert relay.address is not None
    host, port = relay.address
    source = f"the relay at {args.upstream}" if args.upstream else "etcd"
    print(
        f"[lightning-recover] {ANNOUNCEMENT.format(host=host, port=port, source=source)}", file=sys.stderr, flush=True
    )
    try:
        stop.wait()
    finally:
        relay.close()
    return 0


def add_subcommand(sub: Any, help_line: str) -> None:
    """``lightning-recover watch-relay`` (``help_line``: its line in ``lightning-recover --help``)."""
    p = sub.add_parser(
        "watch-relay",
        help=help_line,
        description="Serve the job's keys, watched on etcd once, to the relays of other hosts over TCP; their "
        "launchers name it with --watch-upstream. Both ends prove they hold the job's secret. Runs until SIGTERM.",
        epilog="example: lightning-recover watch-relay --listen 10.0.1.1:7400 --control-plane etcd://10.0.0.5:2379 "
        "--job train-7 --secret-file job.secret",
    )
    p.add_argument("--listen", required=True, help="HOST:PORT to serve on (port 0: any free one, printed)")
    p.add_argument("--upstream", default=None, help="HOST:PORT of a relay to follow instead of etcd (a tree)")
    add_job_arguments(p)
    p.set_defaults(func=_cmd_watch_relay)
