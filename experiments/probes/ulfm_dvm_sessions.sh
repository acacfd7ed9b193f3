#!/bin/bash
# Driver for ulfm_dvm_sessions.py: one fresh DVM, job A (3 ranks, --pset trainers),
# 1 s later job B (1 rank, --pset joiners); see ulfm_dvm_run.sh for why LD_PRELOAD and `env`.
set -u
cd "$(dirname "$0")/../.."
V=$(readlink -f .venv); WORK=${WORK:-/tmp/ulfm_dvm_sess.$$}; mkdir -p "$WORK"
export PATH=$V/bin:$PATH OPAL_PREFIX=$V PRTE_PREFIX=$V PMIX_PREFIX=$V
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
gcc -shared -fPIC -O1 -o "$WORK/prrte_dvm_fix.so" experiments/probes/prrte_dvm_fix.c || exit 2
timeout -k 5 90 prte --allow-run-as-root --report-uri "$WORK/uri" --report-pid "$WORK/pid" > "$WORK/prte.log" 2>&1 &
for i in $(seq 50); do [ -s "$WORK/pid" ] && [ -s "$WORK/uri" ] && break; sleep 0.1; done
DVM=$(cat "$WORK/pid")
D="env LD_PRELOAD=$WORK/prrte_dvm_fix.so mpirun --dvm uri:file:$WORK/uri --forward-signals none --oversubscribe --with-ft ulfm"
APP="env OPAL_PREFIX=$V OMPI_MCA_mpi_ft_enable=1 PYTHONPATH=$PWD"
(timeout -k 3 40 $D --pset trainers -n 3 $APP "$V/bin/python" experiments/probes/ulfm_dvm_sessions.py A > "$WORK/A.log" 2>&1; echo "A rc=$?" >> "$WORK/A.log") &
AP=$!
sleep 1
timeout -k 3 35 $D --pset joiners -n 1 $APP "$V/bin/python" experiments/probes/ulfm_dvm_sessions.py B; echo "B rc=$?"
wait $AP; cat "$WORK/A.log"
pkill -9 -P "$DVM" 2>/dev/null; kill "$DVM" 2>/dev/null; sleep 0.5; kill -9 "$DVM" 2>/dev/null
wait
