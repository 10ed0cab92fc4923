#!/usr/bin/env bash
# One-time setup on a fresh Debian machine (run as root or with passwordless apt):
#   - liburing-dev (io_uring engine) and fio (the device-limit reference of the benchmarks),
#   - nftables (the multi-host tests' asymmetric partitions, tests/hosts.py),
#   - torch==2.13.0 BEFORE the package: a loose torch requirement would pull a multi-GB CUDA build,
#   - the package itself, editable, with its dev extras (builds the native_io extension).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

need_apt=()
[ -f /usr/include/liburing.h ] || need_apt+=(liburing-dev)
command -v fio >/dev/null 2>&1 || need_apt+=(fio)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need_apt+=(etcd-client)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)  # asymmetric partitions in tests/test_netns.py
if [ ${#need_apt[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "setup: apt-get install ${need_apt[*]}"
        apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}" >/dev/null \
            || echo "setup: apt-get failed; continuing (portable engine / no fio reference)"
    else
        echo "setup: cannot install ${need_apt[*]} (not root or no apt-get); continuing without them"
    fi
fi

if ! $PY -c "import torch" 2>/dev/null; then
    $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e ".[dev]"
$PY -c "import native_io, json; print('setup: native_io', json.dumps(native_io.info()))"
