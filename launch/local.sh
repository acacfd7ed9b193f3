#!/usr/bin/env bash
# Run a command on NP ranks of this machine under `mpirun --with-ft ulfm`, with the rendezvous
# TCPStore hosted by this script, OUTSIDE the ranks (so global rank 0 is not special).
#
#   launch/local.sh COMMAND [ARGS...]
#
#   NP=4 launch/local.sh python my_loop.py                 # your loop over HSDPULFMTrainingManager
#   NP=2 launch/local.sh python -m recover_hsdp.train --worker runs/x/launcher/config.yaml
#                                                          # re-run a resolved config as is
# To TRAIN, `recover-hsdp train [overrides]` is the front door: it validates the config and does
# all of this itself. This script is for your own entry points.
#
# Env knobs (defaults):
#   NP=2                 ranks to start
#   OMP_NUM_THREADS=1    exported to every rank
#   PYTHON=<repo>/.venv/bin/python (else python3)   used for the store helper
#   MPIRUN=<next to PYTHON>/mpirun (else mpirun on PATH)
#   MPIRUN_ARGS=""       extra mpirun arguments (word-split), e.g. "--bind-to none"
#   STORE_HOST=127.0.0.1 address the ranks reach the store at
#   RECOVER_HSDP_STORE   if already set (host:port), no store is started
#
# Exit status: mpirun's. Under ULFM mpirun exits 0 even after ranks were SIGKILLed: judge a run
# by its run directory (recover-hsdp verify / summary.json), not by this status.
set -euo pipefail

if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  [ $# -eq 0 ] && exit 2 || exit 0
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=$(command -v python3)
MPIRUN=${MPIRUN:-$(dirname "$PYTHON")/mpirun}
[ -x "$MPIRUN" ] || MPIRUN=$(command -v mpirun)
NP=${NP:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# --mca coll: the failure-tested collective components (no han), = collectives.launch.FT_COLL;
# --mca pml ob1: the only PML ULFM supports (never UCX), = collectives.launch.FT_PML
args=(--with-ft ulfm --mca coll self,basic,tuned,libnbc,ftagree --mca pml ob1 --oversubscribe)
[ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
args+=(-n "$NP" -x OMP_NUM_THREADS -x PYTHONPATH -x PYTHONUNBUFFERED -x RECOVER_HSDP_STORE)

store_pid=""
store_out=""
cleanup() {
  if [ -n "$store_pid" ]; then
    kill "$store_pid" 2>/dev/null || true
    wait "$store_pid" 2>/dev/null || true
  fi
  [ -n "$store_out" ] && rm -f "$store_out"
}
trap cleanup EXIT

if [ -z "${RECOVER_HSDP_STORE:-}" ]; then
  store_out=$(mktemp)
  "$PYTHON" -m recover_hsdp.launcher.store "${STORE_HOST:-127.0.0.1}" >"$store_out" &
  store_pid=$!
  for _ in $(seq 600); do                       # up to 60 s (importing torch on a busy box)
    [ -s "$store_out" ] && break
    kill -0 "$store_pid" 2>/dev/null || { echo "local.sh: the store helper died" >&2; exit 1; }
    sleep 0.1
  done
  RECOVER_HSDP_STORE=$(head -n 1 "$store_out")
  [ -n "$RECOVER_HSDP_STORE" ] || { echo "local.sh: no store address after 60 s" >&2; exit 1; }
  export RECOVER_HSDP_STORE
fi

# shellcheck disable=SC2086  # MPIRUN_ARGS is word-split on purpose
"$MPIRUN" "${args[@]}" ${MPIRUN_ARGS:-} "$@"
