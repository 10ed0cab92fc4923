"""pytest fixtures of real local etcd clusters (``LocalEtcdCluster``), ended by the fixture also on failure.

Skipped (with the reason) where etcd is not installed; ``scripts/setup.sh`` installs it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import pytest

from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster

#: The test clusters' members (and their sessions' autogroups) run at nice -10 where the tests run as root (CI
#: does): a production cluster has cores of its own, while here two test workers' jobs (and the hogged runs' CPU
#: hog) share 2 cores with them, and members at nice 0 were starved past the clients' request deadline.
MEMBER_NICE = -10 if os.geteuid() == 0 else 0


#: The test clusters' data (their write-ahead logs) lives on tmpfs where there is one: etcd wants a device of its
#: own for its log, and on the shared disk the checkpoint tests' writes delayed the members' fsyncs past their
#: election timeout (leaders stepped down; requests failed with EtcdUnavailable).
TMPFS = "/dev/shm"


@dataclass
class TmpfsCluster(LocalEtcdCluster):
    """A :class:`LocalEtcdCluster` whose members' data is on tmpfs (:data:`TMPFS`), removed by :meth:`stop`."""

    def stop(self) -> None:
        super().stop()
        if self.data_root is not None:
            shutil.rmtree(self.data_root, ignore_errors=True)


def local_cluster(directory: str, members: int, **options) -> LocalEtcdCluster:
    """A local TLS etcd of ``members`` members at the tests' priority, its data on tmpfs (not started)."""
    data_root = tempfile.mkdtemp(prefix="lr-etcd-", dir=TMPFS) if os.access(TMPFS, os.W_OK) else None
    return TmpfsCluster(directory, members_count=members, nice=MEMBER_NICE, data_root=data_root, **options)


def need_etcd() -> None:
    if shutil.which("etcd") is None or shutil.which("openssl") is None:
        pytest.skip("etcd-server/openssl not installed (scripts/setup.sh installs them)")


@pytest.fixture(scope="module")
def etcd1(tmp_path_factory):
    """A one-member TLS etcd (starts in well under a second): the store semantics' tests."""
    need_etcd()
    cluster = local_cluster(str(tmp_path_factory.mktemp("etcd1")), 1).start(timeout=20)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd3(tmp_path):
    """A fresh three-member TLS etcd per test (leader kills change it)."""
    need_etcd()
    cluster = local_cluster(str(tmp_path / "etcd3"), 3).start(timeout=30)
    try:
        yield cluster
    finally:
        cluster.stop()
