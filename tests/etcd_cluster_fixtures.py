"""pytest fixtures of real local etcd clusters (``LocalEtcdCluster``), ended by the fixture also on failure.

Skipped (with the reason) where etcd is not installed; ``scripts/setup.sh`` installs it.
"""

from __future__ import annotations

import shutil

import pytest

from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster


def need_etcd() -> None:
    if shutil.which("etcd") is None or shutil.which("openssl") is None:
        pytest.skip("etcd-server/openssl not installed (scripts/setup.sh installs them)")


@pytest.fixture(scope="module")
def etcd1(tmp_path_factory):
    """A one-member TLS etcd (starts in well under a second): the store semantics' tests."""
    need_etcd()
    cluster = LocalEtcdCluster(str(tmp_path_factory.mktemp("etcd1")), members_count=1).start(timeout=20)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd3(tmp_path):
    """A fresh three-member TLS etcd per test (leader kills change it)."""
    need_etcd()
    cluster = LocalEtcdCluster(str(tmp_path / "etcd3"), members_count=3).start(timeout=30)
    try:
        yield cluster
    finally:
        cluster.stop()
