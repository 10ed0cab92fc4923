#!/usr/bin/env bash
# Set-up of a checkout, run by `make demo`, `make test` and every other make target. It never touches
# the machine's Python: everything Python goes into the project-local virtual environment .venv.
#   - system packages (apt-get, as root, when missing): liburing-dev (the io_uring engine), fio (the
#     device-limit reference of the benchmarks), etcd-server + etcd-client + openssl (the etcd tests),
#     nftables (the multi-host tests' asymmetric partitions, tests/hosts.py), slurm-wlm + munge (a real
#     Slurm cluster on namespace nodes, tests/slurm_cluster.py), chromium (the status page in a real headless
#     browser, tests/integration/test_status.py). When one is
#     missing and cannot be installed, setup FAILS and says what to install: a run without them would
#     silently skip what they test.
#   - .venv (python3 -m venv), torch==2.13.0 in it BEFORE the package: a loose torch requirement would
#     pull a multi-GB CUDA build,
#   - the package itself, editable, with its dev extras (builds the native_io extension, and with
#     NATIVE_IO_TESTING=1 its test build native_io._native_io_testing, whose fault injection the tests use;
#     a wheel built without the variable has none).
# Idempotent and fast when nothing changed: a stamp in .venv records the hash of what the Python part was
# built from (pyproject.toml, setup.py, native_io's C sources); the Python part reruns only when it differs.
#
# Environment: PYTHON (the interpreter that creates .venv; default python3), VENV (default .venv),
# LIGHTNING_RECOVER_ALLOW_MISSING=1 (carry on without the system packages: the portable engine only, no
# fio reference, no etcd tests; refused under CI=true).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

fail() {
    echo "setup: ERROR: $*" >&2
    # an apt-get started below is left to finish: stopping it halfway leaves dpkg to repair
    [ -z "${apt_pid:-}" ] || wait "$apt_pid" || true
    exit 1
}

# ---- system packages -------------------------------------------------------------------------------
need_apt=()
[ -f /usr/include/liburing.h ] || need_apt+=(liburing-dev)
command -v fio >/dev/null 2>&1 || need_apt+=(fio)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need_apt+=(etcd-client)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)  # asymmetric partitions in tests/chaos/test_netns.py
# Slurm as a launcher, tested on a real cluster (tests/chaos/test_slurm.py): the daemons are in /usr/sbin
{ [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch >/dev/null 2>&1; } || need_apt+=(slurm-wlm)
[ -x /usr/sbin/munged ] || need_apt+=(munge)
# the status page seen by a real headless browser (tests/integration/test_status.py, the screenshot in docs/howto.md)
{ command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; } || need_apt+=(chromium)
# apt-get runs beside the pip installs below (both mostly wait on downloads); only the native_io build needs
# its result (liburing's header), so the script waits for it just before that build.
apt_pid=
apt_log=$(mktemp)
trap 'rm -f "$apt_log"' EXIT
if [ ${#need_apt[@]} -gt 0 ]; then
    hint="HINT: install them (Debian/Ubuntu: sudo apt-get install ${need_apt[*]}) and rerun"
    if [ "${CI:-}" != true ]; then
        hint+=", or set LIGHTNING_RECOVER_ALLOW_MISSING=1 to go on without them (the tests that need them then skip)"
    fi
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "setup: apt-get install ${need_apt[*]} (beside the pip installs)"
        {
            apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}"
        } >"$apt_log" 2>&1 &
        apt_pid=$!
    elif [ "${LIGHTNING_RECOVER_ALLOW_MISSING:-}" = 1 ] && [ "${CI:-}" != true ]; then
        echo "setup: missing ${need_apt[*]}; going on without them (LIGHTNING_RECOVER_ALLOW_MISSING=1)" >&2
    else
        fail "missing system packages ${need_apt[*]} and cannot install them (not root, or no apt-get). $hint."
    fi
fi

wait_for_apt() {
    [ -n "$apt_pid" ] || return 0
    local rc=0
    wait "$apt_pid" || rc=$?
    apt_pid=
    [ "$rc" = 0 ] && return 0
    tail -n 20 "$apt_log" >&2
    [ "${LIGHTNING_RECOVER_ALLOW_MISSING:-}" = 1 ] && [ "${CI:-}" != true ] \
        || fail "apt-get install ${need_apt[*]} failed (see above). $hint."
    echo "setup: apt-get failed; going on without ${need_apt[*]} (LIGHTNING_RECOVER_ALLOW_MISSING=1)" >&2
}

# ---- the project's virtual environment ---------------------------------------------------------------
# The checkout's own bytecode, as pip writes it for every package it installs: an editable install gets none, and
# with PYTHONDONTWRITEBYTECODE set no process writes it, so every new interpreter would compile the package again.
# checked-hash: a .pyc is used only while its source's hash matches, so an edited file is never run from a stale one.
compile_checkout() {
    "$1" -m compileall -q -j0 --invalidation-mode checked-hash lightning_recover native_io tests benchmarks \
        || echo "setup: a file above does not compile; it runs from source (and fails there)" >&2
}
stamp="$VENV/.lightning-recover-setup"
want=$(cat pyproject.toml setup.py native_io/src/* 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    wait_for_apt
    compile_checkout "$VENV/bin/python"
    exit 0 # already set up from these files
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating the virtual environment $VENV"
    "$BASE_PY" -m venv "$VENV" || fail "$BASE_PY -m venv $VENV failed. HINT: install the venv module (Debian: apt-get install python3-venv) or set PYTHON to an interpreter that has it."
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: pip install torch==2.13.0 (into $VENV)"
    "$PY" -m pip install -q torch==2.13.0
fi
# The package's requirements (read from pyproject.toml) while apt-get may still run; the editable install below
# then only builds.
# (tomllib is Python 3.11's: an older interpreter leaves them to the editable install.)
mapfile -t requirements < <("$PY" -c '
try:
    import tomllib
except ImportError:
    raise SystemExit
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))')
if [ ${#requirements[@]} -gt 0 ]; then
    echo "setup: pip install the requirements of .[dev] (into $VENV)"
    "$PY" -m pip install -q "${requirements[@]}"
fi
wait_for_apt
echo "setup: pip install -e .[dev] (into $VENV; builds native_io and its test build)"
NATIVE_IO_TESTING=1 "$PY" -m pip install -q -e ".[dev]"
"$PY" -c "import native_io, json; print('setup: native_io', json.dumps(native_io.info()))"
compile_checkout "$PY"
echo "$want" >"$stamp"
