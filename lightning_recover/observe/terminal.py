"""``lightning-recover status``: the job's state in a terminal, from its status address or its control plane.

From a status address (``lightning-recover status 127.0.0.1:9400``) it prints what the monitor's ``/status``
answers. Straight from the control plane (``--coordinator HOST:PORT --secret-file F``, or ``--control-plane
etcd://... --job NAME --secret-file F`` with the etcd TLS files) it reads the job's keys itself for ``--sample`` seconds and
builds the same board the monitor keeps: heartbeat ages are then measured over that window (a replica whose
beat did not move in it shows the whole window), and the history (events, recoveries) starts with the sample.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from lightning_recover.control_plane import config
from lightning_recover.control_plane.connect import connect
from lightning_recover.control_plane.embedded import peek
from lightning_recover.errors import RecoverError
from lightning_recover.observe.board import StatusBoard
from lightning_recover.protocol.messages import JobSecret, Sealer, peek_all

log = logging.getLogger(__name__)

#: Seconds between two reads of the heartbeats while sampling a control plane.
SAMPLE_PERIOD = 0.1


def fetch_status(address: str, timeout: float = 5.0) -> dict[str, Any]:
    """The ``/status`` JSON of the monitor serving at ``address`` (``HOST:PORT`` or an ``http://`` URL).

    Raises:
        RecoverError: nothing answers there, or it does not serve a job now (503: names who does).
    """
    base = address if address.startswith(("http://", "https://")) else f"http://{address}"
    url = base.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace").strip()
        raise RecoverError(f"{url} answered {exc.code}: {body}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RecoverError(
            f"no status at {url}: {getattr(exc, 'reason', exc)}. HINT: give the address the job was started "
            "with (--status-address), or read the control plane (--coordinator/--control-plane)"
        ) from None


def sample_control_plane(store: Any, sealer: Sealer, seconds: float) -> dict[str, Any]:
    """The job's board after reading its keys for ``seconds`` (heartbeats every :data:`SAMPLE_PERIOD`)."""
    replicas = int(sealer.open("meta/replicas", _must(store, "meta/replicas")))
    size = int(sealer.open("meta/replica_size", _must(store, "meta/replica_size")))
    keys = [(r, f"hb/{r}" if size == 1 else f"hb/{r}/i{i}") for r in range(replicas) for i in range(size)]
    board = StatusBoard(replicas, size, "read from the control plane")
    beats: dict[str, tuple[int, int, float]] = {}
    start = time.monotonic()
    while True:
        now = time.monotonic()
        heartbeats = {}
        for (r, key), raw in zip(keys, peek_all(store, [k for _, k in keys])):
            if raw is None:
                continue
            try:
                hb = json.loads(sealer.open_sequenced(key, raw)[1])
            except (RecoverError, ValueError):
                continue  # not genuine: no heartbeat
            beat = (int(hb.get("inc", 0)), int(hb.get("beat", 0)))
            if beats.get(key, (None, None))[:2] != beat:
                beats[key] = (*beat, start if key not in beats else now)
            heartbeats[key] = (r, hb)
        board.poll(now, store, sealer, heartbeats, beats)
        if now - start >= seconds:
            return board.snapshot()
        time.sleep(SAMPLE_PERIOD)


def _must(store: Any, key: str) -> bytes:
    raw = peek(store, key)
    if raw is None:
        raise RecoverError(f"no job there: its key {key!r} is absent. HINT: check the address and --job NAME")
    return raw


def format_status(status: dict[str, Any]) -> str:
    """The terminal rendering of a ``/status`` document."""
    recoveries = ", ".join(f"{cause} {n}" for cause, n in status["recoveries"].items())
    lines = [
        f"live replicas {status['live_replicas']}/{status['replicas']}   generation {status['generation']}   "
        f"committed step {status['committed_step']}   {status['microbatches_per_second']:.1f} microbatches/s",
        f"recoveries: {recoveries}   control plane: {status['control_plane']}",
        "",
        f"{'replica':>7} {'host':<16} {'inc':>4} {'state':<14} {'gen':>4} {'step':>6} {'quota':>5} {'phase':<8} {'beat age':>8}",
    ]
    for row in status["table"]:
        age = "-" if row["heartbeat_age"] is None else f"{row['heartbeat_age']:.2f}s"
        lines.append(
            f"{row['replica']:>7} {row['host'][:16] or '-':<16} {row['incarnation']:>4} {row['state']:<14} "
            f"{row['generation'] if row['generation'] >= 0 else '-':>4} {row['step'] if row['step'] >= 0 else '-':>6} "
            f"{row['quota']:>5} {row['phase'][:8] or '-':<8} {age:>8}"
        )
    events = status.get("events", [])[-10:]
    if events:
        lines += ["", "last events:"]
        for e in events:
            lines.append(
                f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))}  g{e['generation']}  {e.get('what', e['kind'])}"
            )
    return "\n".join(lines)


def read_status(args: argparse.Namespace) -> dict[str, Any]:
    """The status the command's arguments point at (see the module's docstring).

    Raises:
        RecoverError: nothing to read there, or the arguments name no source.
    """
    if args.address:
        return fetch_status(args.address, args.timeout)
    if args.control_plane:
        settings = config.parse(
            args.control_plane, cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key, job=args.job
        )
        if settings is None or not settings.job:
            raise RecoverError("--control-plane etcd://... needs the job's name. HINT: add --job NAME")
        store = settings.store(args.timeout)
        try:
            # The job's secret is never stored in etcd: the one its launchers were given.
            secret = JobSecret.from_file(args.secret_file) if args.secret_file else JobSecret.from_env()
            return sample_control_plane(store, Sealer(secret), args.sample)
        finally:
            store.close()
    if args.coordinator:
        secret = JobSecret.from_file(args.secret_file) if args.secret_file else JobSecret.from_env()
        store = connect(args.coordinator, args.timeout)
        return sample_control_plane(store, Sealer(secret), args.sample)
    raise RecoverError(
        "lightning-recover status: where is the job? HINT: give its status address (lightning-recover status "
        "127.0.0.1:9400), or --coordinator HOST:PORT --secret-file F, or --control-plane etcd://... --job NAME --secret-file F"
    )


def status_main(args: argparse.Namespace) -> int:
    """``lightning-recover status``: print the job's state once (``--json``: the ``/status`` document)."""
    try:
        status = read_status(args)
    except (RecoverError, ValueError, OSError) as exc:
        raise SystemExit(f"lightning-recover status: {exc}") from None
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``lightning-recover status``."""
    p.add_argument("address", nargs="?", default=None, help="the job's status address (HOST:PORT or http://...)")
    p.add_argument("--coordinator", default=None, help="read the embedded coordinator at HOST:PORT directly")
    p.add_argument(
        "--secret-file",
        default=None,
        help="with --coordinator: the job's secret (default $LIGHTNING_RECOVER_SECRET_FILE)",
    )
    p.add_argument("--control-plane", default=None, help="read the job's keys in etcd directly: etcd://HOST:PORT,...")
    p.add_argument("--job", default=None, help="with --control-plane: the job's name (default $LIGHTNING_RECOVER_JOB)")
    p.add_argument(
        "--etcd-cacert", default=None, help="CA of the etcd members (default $LIGHTNING_RECOVER_ETCD_CACERT)"
    )
    p.add_argument(
        "--etcd-cert", default=None, help="client certificate for etcd (default $LIGHTNING_RECOVER_ETCD_CERT)"
    )
    p.add_argument("--etcd-key", default=None, help="its private key (default $LIGHTNING_RECOVER_ETCD_KEY)")
    p.add_argument("--sample", type=float, default=1.0, help="seconds to read a control plane for (heartbeat ages)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    p.add_argument("--json", action="store_true", help="print the /status JSON document")
