"""Which control plane a job uses, from ``--control-plane``/``control_plane=`` or the environment.

``embedded`` (the default): the TCPStore coordinator the launcher starts on one host.
``etcd://HOST:PORT[,HOST:PORT...]``: an etcd cluster over TLS with client certificates
(``--etcd-cacert/--etcd-cert/--etcd-key`` or ``LIGHTNING_RECOVER_ETCD_CACERT/_CERT/_KEY``).
``etcd+insecure://...``: plain-text etcd, accepted only when every endpoint is a loopback address.
Every misconfiguration is a :class:`~lightning_recover.errors.RecoverError` with a HINT.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_recover import env
from lightning_recover.errors import RecoverError

if TYPE_CHECKING:  # imported where a store is made: the embedded default never loads etcd's modules
    from lightning_recover.control_plane.etcd_store import EtcdStore

EMBEDDED = "embedded"
SCHEMES = ("etcd://", "etcd+insecure://")
#: Seconds an etcd request may take, failovers between members included, before the control plane
#: counts as lost (a replica stops, a launcher gives up its monitor role): the launcher's bound for a
#: silent embedded coordinator at the default heartbeat timeout (``max(5, 2 x 1 + 1)``). A replica's requests
#: take its ``store_timeout`` instead (``ControlStore``), the bound its operations have on the embedded coordinator.
DEFAULT_REQUEST_TIMEOUT = 5.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class EtcdSettings:
    """Where the job's etcd is and how to authenticate to it; ``job`` names its key prefix."""

    endpoints: tuple[str, ...]
    job: str
    cacert: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    insecure: bool = False
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT

    @property
    def url(self) -> str:
        return ("etcd+insecure://" if self.insecure else "etcd://") + ",".join(self.endpoints)

    @property
    def prefix(self) -> str:
        """Every key of the job lives under this prefix."""
        return f"/lightning-recover/{self.job}/"

    def client(self, timeout: Optional[float] = None):  # -> EtcdClient (imported lazily: no cycle, fast CLI)
        from lightning_recover.control_plane.etcd_client import EtcdClient

        return EtcdClient(
            self.endpoints,
            cacert=self.cacert,
            cert=self.cert,
            key=self.key,
            timeout=self.request_timeout if timeout is None else timeout,
            allow_insecure=self.insecure,
        )

    def store(self, timeout: Optional[float] = None, relay: Optional[str] = None):  # -> EtcdStore
        """The job's store; its view of the job's keys follows the host's watch relay at ``relay`` if given."""
        from lightning_recover.control_plane.etcd_store import EtcdStore

        # Heartbeats beside the watched keys (``/{job}/hb/``): only the monitor's view receives them.
        return EtcdStore(self.client(timeout), self.watched_prefix, root=self.prefix, apart="hb/", relay=relay)

    @property
    def watched_prefix(self) -> str:
        """The keys every process's view watches (a watch relay serves exactly these)."""
        return self.prefix + "kv/"

    def environment(self) -> dict[str, str]:
        """What a child process needs to reach the same control plane (see :func:`from_environment`)."""
        out = {env.CONTROL_PLANE: self.url, env.JOB: self.job}
        for name, value in ((env.ETCD_CACERT, self.cacert), (env.ETCD_CERT, self.cert), (env.ETCD_KEY, self.key)):
            if value:
                out[name] = value
        return out


def parse(
    spec: Optional[str],
    *,
    cacert: Optional[str] = None,
    cert: Optional[str] = None,
    key: Optional[str] = None,
    job: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Optional[EtcdSettings]:
    """The etcd settings of ``spec`` (None: the embedded coordinator). Unset arguments come from ``environ``."""
    environ = os.environ if environ is None else environ
    spec = spec if spec is not None else environ.get(env.CONTROL_PLANE)
    if spec is None or spec.strip() in ("", EMBEDDED):
        return None
    spec = spec.strip()
    if not spec.startswith(SCHEMES):
        raise RecoverError(
            f"control plane {spec!r} is not understood. HINT: use `embedded` (default) or "
            "etcd://HOST:PORT[,HOST:PORT...] (set --control-plane or " + env.CONTROL_PLANE + ")"
        )
    insecure = spec.startswith("etcd+insecure://")
    endpoints = tuple(e.strip() for e in spec.split("://", 1)[1].rstrip("/").split(",") if e.strip())
    if not endpoints:
        raise RecoverError(f"control plane {spec!r} names no etcd member. HINT: etcd://10.0.0.1:2379,10.0.0.2:2379")
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RecoverError(f"etcd endpoint {e!r} in {spec!r} is not HOST:PORT. HINT: e.g. etcd://10.0.0.1:2379")
    files = {
        "cacert": cacert or environ.get(env.ETCD_CACERT),
        "cert": cert or environ.get(env.ETCD_CERT),
        "key": key or environ.get(env.ETCD_KEY),
    }
    if insecure:
        remote = [e for e in endpoints if not _is_loopback(e.rpartition(":")[0])]
        if remote:
            raise RecoverError(
                f"plain-text etcd is accepted on loopback only, and {remote} is not loopback: anyone on the "
                "network could read and forge the job's control plane. HINT: use etcd:// with "
                "--etcd-cacert/--etcd-cert/--etcd-key (`lightning-recover etcd up` makes a TLS cluster)"
            )
        files = {k: None for k in files}
    else:
        missing = [f"--etcd-{k}" for k, v in files.items() if not v]
        if missing:
            raise RecoverError(
                f"etcd control plane {spec} without {', '.join(missing)}: lightning-recover talks to etcd over "
                f"TLS with a client certificate. HINT: pass --etcd-cacert/--etcd-cert/--etcd-key (or set "
                f"{env.ETCD_CACERT}, {env.ETCD_CERT}, {env.ETCD_KEY}; `lightning-recover etcd up` prints them); "
                "for a loopback experiment only, etcd+insecure://127.0.0.1:PORT"
            )
        for what, path in files.items():
            if not os.path.isfile(path):
                raise RecoverError(f"the etcd {what} file {path} does not exist. HINT: check --etcd-{what}")
        mode = stat.S_IMODE(os.stat(files["key"]).st_mode)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise RecoverError(
                f"the etcd client key {files['key']} is readable by other users (mode {mode:o}). "
                f"HINT: chmod 600 {files['key']}"
            )
    job = job or environ.get(env.JOB)
    if job is not None and (not job or "/" in job or len(job) > 128):
        raise RecoverError(f"job name {job!r}: 1-128 characters without '/'. HINT: e.g. --job llm-run-7")
    return EtcdSettings(endpoints, job or "", insecure=insecure, **files)


def with_job(settings: EtcdSettings, job: Optional[str]) -> EtcdSettings:
    """``settings`` with the job's name set: the one given, or a fresh random one for a single launcher."""
    from dataclasses import replace

    return replace(settings, job=job or settings.job or "job-" + secrets.token_hex(6))


def connect_store(addr: str, timeout: float, request_timeout: Optional[float] = None) -> EtcdStore:
    """The replica's (or launcher's) store for an ``etcd://`` coordinator address: TLS files and the job's
    name from the environment the launcher handed down; ``request_timeout`` bounds each request (None: the
    settings'). Unreachable etcd -> ``CoordinatorLostError``."""
    from lightning_recover.control_plane.etcd_client import EtcdRequestError, EtcdUnavailable
    from lightning_recover.errors import CoordinatorLostError

    settings = parse(addr)
    if settings is None or not settings.job:
        raise RecoverError(
            f"{env.COORDINATOR}={addr} names an etcd control plane but {env.JOB} (the job's name) is not set. "
            "HINT: start replicas with `lightning-recover run --control-plane ...`, or give every process of "
            f"the job the same {env.JOB}"
        )
    store = settings.store(request_timeout, relay=os.environ.get(env.WATCH_RELAY) or None)
    store.set_timeout(datetime.timedelta(seconds=timeout))
    try:
        store.check(["meta/replicas"])
    except (EtcdUnavailable, EtcdRequestError) as exc:
        raise CoordinatorLostError(
            f"cannot reach the etcd control plane {settings.url}: {exc}. HINT: check that a majority of the "
            f"members run and {env.ETCD_CACERT}/{env.ETCD_CERT}/{env.ETCD_KEY}"
        ) from exc
    return store


def control_plane_of(options: object) -> Optional[EtcdSettings]:
    """The etcd settings a strategy's ``control_plane=`` option (or the environment) names, with a job name."""
    settings = parse(getattr(options, "control_plane", None))
    return with_job(settings, None) if settings is not None else None
