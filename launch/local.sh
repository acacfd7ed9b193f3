#!/usr/bin/env bash
# Run a rank program on NP ranks of this machine, supervised: a thin wrapper over
#
#   recover-hsdp launch -n $NP [--run-dir $RUN_DIR] [--mpirun-arg A ...] -- COMMAND [ARGS...]
#
# (recover_hsdp/launcher/launch_cmd.py: the store served outside the ranks, heartbeats and errors
# in the run directory, the hang watchdog, the reaper, start-up retry, an exit code judged from
# what the ranks left; `recover-hsdp launch --help` explains it).
#
#   NP=4 launch/local.sh python examples/custom_loop.py      # your loop over the manager
#
# To TRAIN, `recover-hsdp train [overrides]` is the front door: it validates the config and does
# all of this itself. This script is for your own entry points.
#
# Env knobs (defaults):
#   NP=2                 ranks to start (the loop's replicas x shard_size)
#   RUN_DIR              the run directory (default runs/launch-<time>)
#   OMP_NUM_THREADS=1    exported to every rank
#   PYTHON=<repo>/.venv/bin/python (else python3)   runs the launcher (and its mpirun)
#   MPIRUN=<next to PYTHON>/mpirun (else mpirun on PATH)
#   MPIRUN_ARGS=""       extra mpirun arguments (word-split), e.g. "--bind-to none"
#
# Exit status: recover-hsdp launch's, the table of every command (docs/cli.md "Exit codes": 0
# a replica finished; 1 none did; 2 bad arguments or the same input error everywhere; 3 time
# limit; 5 no mpirun / no ULFM; 130 interrupted).
set -euo pipefail

if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  [ $# -eq 0 ] && exit 2 || exit 0
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=$(command -v python3)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -n "${MPIRUN:-}" ] && export MPIRUN

opts=(-n "${NP:-2}")
[ -n "${RUN_DIR:-}" ] && opts+=(--run-dir "$RUN_DIR")
# shellcheck disable=SC2086  # MPIRUN_ARGS is word-split on purpose
for a in ${MPIRUN_ARGS:-}; do opts+=(--mpirun-arg "$a"); done
exec "$PYTHON" -m recover_hsdp.cli launch "${opts[@]}" -- "$@"
