"""The control plane's command-line options, shared by ``lightning-recover run`` and ``torchrun``:
``--control-plane``, the etcd TLS files, ``--job`` and ``--local-replicas`` (docs/control_plane.md), and what its
monitor shows: ``--status-address``, ``--event-log`` (docs/howto.md, "Watching a job")."""

from __future__ import annotations

import argparse
import os
from typing import Any

from lightning_recover import env
from lightning_recover.control_plane import config
from lightning_recover.launch.coordinator_process import add_status_arguments


def control_plane_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``control_plane=`` and ``local_replicas=`` of :func:`supervise` from the command line (and environment)."""
    settings = config.parse(
        args.control_plane, cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key, job=args.job
    )
    local = None
    if args.local_replicas:
        try:
            local = [int(r) for r in args.local_replicas.split(",") if r.strip()]
        except ValueError:
            raise ValueError(
                f"--local-replicas {args.local_replicas!r}: comma-separated replica ids, e.g. 0,1"
            ) from None
    if settings is not None and local is not None and not settings.job:
        raise ValueError(
            "--local-replicas: the launchers of one job find each other by its name. HINT: give every one "
            f"the same --job NAME (or {env.JOB})"
        )
    return {
        "control_plane": config.with_job(settings, args.job) if settings else None,
        "local_replicas": local,
        # Checked with their environment variables in supervise() (host_relay.relay_placement).
        "watch_upstream": args.watch_upstream,
        "watch_rack": args.watch_rack,
        "watch_rack_address": args.watch_rack_address,
        "status_address": args.status_address,
        "event_log": args.event_log,
    }


def add_control_plane_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--control-plane",
        default=None,
        help="embedded (default: a coordinator process on this host) or etcd://HOST:PORT[,HOST:PORT...] "
        f"(default ${env.CONTROL_PLANE}); etcd needs --etcd-cacert/--etcd-cert/--etcd-key",
    )
    p.add_argument("--etcd-cacert", default=None, help=f"CA of the etcd members (default ${env.ETCD_CACERT})")
    p.add_argument("--etcd-cert", default=None, help=f"client certificate for etcd (default ${env.ETCD_CERT})")
    p.add_argument("--etcd-key", default=None, help=f"its private key, 0600 (default ${env.ETCD_KEY})")
    p.add_argument(
        "--job",
        default=None,
        help=f"the job's name in etcd (default ${env.JOB}, else a fresh one); the same on every launcher of the job",
    )
    p.add_argument(
        "--local-replicas",
        default=None,
        help="with etcd: the replica ids this launcher starts, e.g. 0,1 (default all); one launcher per host, "
        "each a candidate for the monitor role",
    )
    p.add_argument(
        "--watch-upstream",
        default=None,
        help="with etcd: HOST:PORT of a `lightning-recover watch-relay` this host's relay follows instead of "
        f"watching etcd (one watch of etcd per rack instead of per host; default ${env.WATCH_UPSTREAM})",
    )
    p.add_argument(
        "--watch-rack",
        default=None,
        help="with etcd: this host's rack; the launchers of one rack elect one of their relays to watch etcd and "
        f"serve the others over TCP, and elect another when it ends (default ${env.WATCH_RACK})",
    )
    p.add_argument(
        "--watch-rack-address",
        default=None,
        help="the address this host serves its rack's relay on where elected (default: the address it reaches "
        f"etcd from; ${env.WATCH_RACK_ADDRESS})",
    )
    add_status_arguments(p)


def job_arguments(args: argparse.Namespace) -> tuple[config.EtcdSettings | None, str | None]:
    """What :func:`add_job_arguments`' options (or the environment) name: the job's etcd settings (None: no etcd
    control plane) and its secret file (None: not given)."""
    settings = config.parse(
        args.control_plane, cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key, job=args.job
    )
    return settings, args.secret_file or os.environ.get(env.SECRET_FILE)


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The options that name a running job on etcd and its secret, for a command that acts on it (``leave``,
    ``watch-relay``)."""
    p.add_argument("--secret-file", default=None, help=f"the job's secret file (${env.SECRET_FILE})")
    p.add_argument("--control-plane", default=None, help=f"etcd://HOST:PORT,... (${env.CONTROL_PLANE})")
    p.add_argument("--etcd-cacert", default=None, help=f"CA of the etcd members (${env.ETCD_CACERT})")
    p.add_argument("--etcd-cert", default=None, help=f"client certificate for etcd (${env.ETCD_CERT})")
    p.add_argument("--etcd-key", default=None, help=f"its private key (${env.ETCD_KEY})")
    p.add_argument("--job", default=None, help=f"the job's name in etcd (${env.JOB})")
