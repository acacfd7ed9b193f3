#!/bin/bash
# Probe driver: a newcomer job joins a running ULFM job through a persistent PRRTE DVM.
#   bash experiments/probes/ulfm_dvm_run.sh SCEN [SCEN...]   # SCEN: solo ok a b c c2 d e i ic im a2 dvm
#   NB=2 bash experiments/probes/ulfm_dvm_run.sh ok a         # a 2-process newcomer job
#   EXTRA=OMPI_MCA_mpi_pmix_connect_timeout=5 bash experiments/probes/ulfm_dvm_run.sh b c2
# What each scenario does and what it printed: ulfm_dvm_join.py's docstring; figures:
# ulfm_dvm_times.py. Seen 2026-12-01: every scenario ran as its docstring says; the hanging
# ones (b, c2, im) end at the 40 s box and leave processes under the DVM, killed below by pid.
# For each scenario: a fresh DVM (prte, its own --report-uri/--report-pid under $WORK), job A
# (3 ranks) then 1 s later job B (1 rank) launched on it with `mpirun --dvm uri:file:URI`, both
# time-boxed, then the DVM and anything left of its jobs are killed by pid.
# Three things make Open MPI 5.0.11 (PRRTE 3.0.14) from PyPI work this way (docs/rejoin.md):
#  1. `mpirun --dvm` segfaults in prun_common (openpmix/prrte #2364): experiments/probes/prrte_dvm_fix.c,
#     LD_PRELOADed into mpirun, constructs the list it walks; plus `--forward-signals none`.
#  2. `--with-ft ulfm` does not reach a DVM job's environment (OMPI_MCA_mpi_ft_enable is missing)
#     and only the first `-x` is forwarded: the app is started through `env VAR=... python`.
#  3. The DVM's own environment must carry OPAL_PREFIX (else help-file noise in every rank).
set -u
cd "$(dirname "$0")/../.."
V=$(readlink -f .venv); WORK=${WORK:-/tmp/ulfm_dvm.$$}; mkdir -p "$WORK"
export PATH=$V/bin:$PATH OPAL_PREFIX=$V PRTE_PREFIX=$V PMIX_PREFIX=$V
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
gcc -shared -fPIC -O1 -o "$WORK/prrte_dvm_fix.so" experiments/probes/prrte_dvm_fix.c || exit 2
for S in "$@"; do
  echo "===== scenario $S"
  rm -f "$WORK/uri" "$WORK/pid" "$WORK/port" "$WORK/port.2"
  timeout -k 5 120 prte --allow-run-as-root --report-uri "$WORK/uri" --report-pid "$WORK/pid" \
      > "$WORK/prte.$S.log" 2>&1 &
  for i in $(seq 50); do [ -s "$WORK/pid" ] && [ -s "$WORK/uri" ] && break; sleep 0.1; done
  DVM=$(cat "$WORK/pid"); T0=$(date +%s.%N)
  D="env LD_PRELOAD=$WORK/prrte_dvm_fix.so mpirun --dvm uri:file:$WORK/uri --forward-signals none --oversubscribe --with-ft ulfm"
  APP="env OPAL_PREFIX=$V OMPI_MCA_mpi_ft_enable=1 ${EXTRA:-} OMPI_MCA_coll=self,basic,tuned,libnbc,ftagree PYTHONPATH=$PWD PORT_FILE=$WORK/port SCEN=$S"
  if [ "$S" = dvm ]; then     # job A alone, then the DVM is SIGKILLed under it
    (timeout -k 3 30 $D -n 3 $APP "$V/bin/python" experiments/probes/ulfm_dvm_join.py solo; echo "job rc=$?") &
    sleep 6; echo "ranks alive before: $(grep -l "PORT_FILE=$WORK/port" /proc/[0-9]*/environ 2>/dev/null | wc -l)"
    echo "SIGKILL DVM at=$(echo "$(date +%s.%N) % 1000" | bc)"; kill -9 "$DVM"; sleep 4
    echo "ranks left 4 s later: $(grep -l "PORT_FILE=$WORK/port" /proc/[0-9]*/environ 2>/dev/null | wc -l)"
    wait
  fi
  [ "$S" = solo ] && { timeout -k 3 25 $D -n 3 $APP "$V/bin/python" experiments/probes/ulfm_dvm_join.py solo; echo "solo rc=$?"; }
  if [ "$S" != solo ] && [ "$S" != dvm ]; then
    (timeout -k 3 40 $D -n 3 $APP "$V/bin/python" experiments/probes/ulfm_dvm_join.py A > "$WORK/A.$S.log" 2>&1; echo "A rc=$?" >> "$WORK/A.$S.log") &
    AP=$!
    sleep 1; printf "B launched at=%.3f\n" "$(echo "$(date +%s.%N) % 1000" | bc)"
    BS=$S; [ "$S" = a2 ] && BS=a
    timeout -k 3 30 $D -n ${NB:-1} ${APP/SCEN=$S/SCEN=$BS} "$V/bin/python" experiments/probes/ulfm_dvm_join.py B; echo "B rc=$?"
    if [ "$S" = a2 ]; then
      timeout -k 3 30 $D -n 1 ${APP/SCEN=$S/SCEN=ok} "$V/bin/python" experiments/probes/ulfm_dvm_join.py B \
        PORT2; echo "B2 rc=$?"
    fi
    wait $AP; cat "$WORK/A.$S.log"
  fi
  printf 'scenario %s wall %.1f s\n' "$S" "$(echo "$(date +%s.%N) - $T0" | bc)"
  pkill -9 -P "$DVM" 2>/dev/null; kill "$DVM" 2>/dev/null; sleep 0.5; kill -9 "$DVM" 2>/dev/null
  wait
done
