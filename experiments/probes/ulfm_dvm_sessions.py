"""Probe: MPI Sessions as the join path between two jobs on one PRRTE DVM.

    bash experiments/probes/ulfm_dvm_sessions.sh        # starts its own DVM, runs A (3) then B (1)

Each process (no MPI_Init: MPI_Session_init only) lists the process sets it can see. Job A is
launched with `--pset trainers`, job B with `--pset joiners`; if each sees the other's pset,
both build MPI_Group_union(trainers, joiners) and MPI_Comm_create_from_group(union, tag) (which
is PMIx_Group_construct across the two jobs), then MPI_Allreduce on it. Every wait is bounded by
the driver's `timeout`.

Seen 2026-12-01 (Open MPI 5.0.11 / PRRTE 3.0.14, DVM): every process of both jobs sees only
['mpi://WORLD', 'mpi://SELF', 'mpix://SHARED'], also after 10 s; the `--pset` names are not
listed (not even with a plain `mpirun --pset trainers -n 2`), so no cross-job group this way.
"""
import os, sys, time
from mpi4py import MPI
import numpy as np

role = sys.argv[1]
T0 = time.time()
s = MPI.Session.Init(errhandler=MPI.ERRORS_RETURN)
names = [s.Get_nth_pset(i) for i in range(s.Get_num_psets())]
g_self = s.Create_group("mpi://WORLD")
me = g_self.Get_rank()


def say(msg):
    print(f"[{role}{me}] {msg} t={time.time() - T0:.3f}", flush=True)


say(f"psets seen: {names}")
want = ["trainers", "joiners"]
deadline = time.time() + 10
while not all(any(n.endswith(w) for n in names) for w in want) and time.time() < deadline:
    time.sleep(0.5)     # B may not be launched yet: ask again (a fresh session re-queries)
    s2 = MPI.Session.Init(errhandler=MPI.ERRORS_RETURN)
    names = [s2.Get_nth_pset(i) for i in range(s2.Get_num_psets())]
    s2.Finalize()
say(f"psets after wait: {names}")
full = {w: next((n for n in names if n.endswith(w)), None) for w in want}
if None in full.values():
    say(f"a pset is missing: {full}; no cross-job group possible this way")
    s.Finalize()
    os._exit(0)
try:
    ga = s.Create_group(full["trainers"])
    gb = s.Create_group(full["joiners"])
    u = MPI.Group.Union(ga, gb)
    say(f"union group size {u.Get_size()}, my rank {u.Get_rank()}")
    t = time.time()
    c = MPI.Intracomm.Create_from_group(u, "recover_hsdp.join.1", errhandler=MPI.ERRORS_RETURN)
    say(f"comm from group size {c.Get_size()} in {time.time() - t:.3f}s")
    out = np.zeros(1, dtype=np.int64)
    c.Allreduce(np.ones(1, dtype=np.int64), out)
    say(f"allreduce={int(out[0])}")
except MPI.Exception as e:
    say(f"failed class {e.Get_error_class()}: {e.Get_error_string()}")
s.Finalize()
os._exit(0)
