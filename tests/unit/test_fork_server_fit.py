"""Whether a warm fork server fits a job (``launch/fork_server.py`` ``fit_key``, ``key_differences``): pure logic."""

from __future__ import annotations

import pytest

from lightning_recover.env import CONTROL_PROCESS, FORK_SERVER
from lightning_recover.launch.fork_server import fit_key, key_differences

BASE = {"PATH": "/usr/bin", "PYTHONPATH": "/repo", "OMP_NUM_THREADS": "1", "HOME": "/root"}


def test_only_the_import_time_environment_is_part_of_the_key():
    key = fit_key(dict(BASE, LIGHTNING_RECOVER_INJECT="kill", **{FORK_SERVER: "/s", CONTROL_PROCESS: "1"}), ["torch"])
    assert key["environment"] == {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/repo", CONTROL_PROCESS: "1"}
    assert key["preload"] == "torch"
    assert set(key["namespaces"]) == {"net", "mnt", "pid", "ipc", "uts", "user", "cgroup"}


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, []),
        ({"HOME": "/home/other", "LIGHTNING_RECOVER_REPLICA": "3", "PL_GLOBAL_SEED": "7"}, []),  # read when used
        ({"PYTHONPATH": "/elsewhere"}, ["environment PYTHONPATH"]),
        (
            {"OMP_NUM_THREADS": "4", "TORCH_CPP_LOG_LEVEL": "INFO"},
            ["environment OMP_NUM_THREADS", "environment TORCH_CPP_LOG_LEVEL"],
        ),
        ({"LD_PRELOAD": "/lib/x.so"}, ["environment LD_PRELOAD"]),
    ],
)
def test_a_job_fits_unless_what_its_processes_would_import_with_differs(change, expected):
    server = fit_key(BASE, ["torch", "lightning"])
    job = fit_key(dict(BASE, **change), ["torch", "lightning"])
    assert key_differences(server, job) == expected


def test_where_a_process_runs_and_what_it_preloads_are_compared_field_by_field():
    ours = fit_key(BASE, ["torch", "transformers"])
    theirs = dict(ours, preload="torch,lightning", cgroup="0::/slurm/job_7\n")
    theirs["namespaces"] = dict(ours["namespaces"], net="net:[4026532999]")
    assert key_differences(theirs, ours) == ["preload", "namespaces net", "cgroup"]
    assert key_differences({}, ours) == list(ours), "a server that sends no key fits nothing"


@pytest.mark.parametrize(
    "server, job, fits",
    [
        (["torch", "torch.distributed", "lightning"], ["torch", "torch.distributed"], True),  # a torchrun job
        (["torch", "lightning"], ["torch", "lightning"], True),
        (["torch"], ["torch", "lightning"], False),
        (["torch", "lightning"], ["torch", "transformers"], False),
        (["torch"], [], True),
    ],
)
def test_a_server_that_imported_more_than_the_job_preloads_fits(server, job, fits):
    assert (key_differences(fit_key(BASE, server), fit_key(BASE, job)) == []) is fits
