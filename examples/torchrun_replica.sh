#!/usr/bin/env bash
# One torchrun agent per replica, under lightning-recover's tolerant launcher.
#
#   bash examples/torchrun_replica.sh                 # 2 replicas x 1 process, 10 steps
#   REPLICAS=4 STEPS=20 bash examples/torchrun_replica.sh
#   INJECT=kill:replica=1:step=4:phase=backward bash examples/torchrun_replica.sh
#   PYTHON=/path/to/env/bin/python bash examples/torchrun_replica.sh   # default: .venv/bin/python if there
#
# `lightning-recover torchrun --replicas N --max-restarts K -- script.py ARGS` starts the coordinator
# and N torchrun agents; each agent runs script.py with LIGHTNING_RECOVER_REPLICA=i and restarts
# only its own replica's workers (at most K times). A replica that fails for good is recomputed
# around by the others inside the step, exactly as with `lightning-recover run`.
# Multi-node: see docs/howto.md ("torchrun, several hosts").
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's environment (`make setup`) unless one is active or PYTHON names an interpreter: the
# machine's own python has no torch.
if [ -z "${PYTHON:-}" ]; then
    if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
REPLICAS=${REPLICAS:-2}
STEPS=${STEPS:-10}
MAX_RESTARTS=${MAX_RESTARTS:-0}
args=(--replicas "$REPLICAS" --max-restarts "$MAX_RESTARTS")
if [ -n "${INJECT:-}" ]; then args+=(--inject "$INJECT"); fi
exec "$PYTHON" -m lightning_recover.cli torchrun "${args[@]}" -- \
    examples/fabric_gpt.py --replicas "$REPLICAS" --steps "$STEPS" --microbatches $((2 * REPLICAS))
