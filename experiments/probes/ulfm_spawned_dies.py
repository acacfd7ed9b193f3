"""Probe: is the death of a SPAWNED newcomer survivable under ULFM?

    KEYS=pmix.continuous mpirun -x KEYS --with-ft ulfm --oversubscribe -n 3 python experiments/probes/ulfm_spawned_dies.py

The survivors spawn + merge one process which SIGKILLs itself after joining. Seen 2026-11-30
(Open MPI 5.0.11): prterun "noticed that process rank 0 ... exited on signal 9" and ABORTS THE
WHOLE JOB, with or without the spawn info keys pmix.continuous / pmix.recover /
PMIX_JOB_CONTINUOUS / PMIX_JOB_RECOVERABLE (upstream: open-mpi/ompi #13325, #12585).
"""
import os, sys, signal, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
KEYS = os.environ.get("KEYS","").split(",")
parent = MPI.Comm.Get_parent()
def agree_shrink(c, who):
    c.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        c.Barrier(); return c
    except MPI.Exception as e:
        print(f"[{who}] merged barrier failed class {e.Get_error_class()}", flush=True)
    c.Revoke()
    t0=time.time(); s = c.Shrink(); print(f"[{who}] merged shrink -> {s.Get_size()} {time.time()-t0:.3f}s", flush=True)
    return s
if parent != MPI.COMM_NULL:
    merged = parent.Merge(high=True)
    gen = int(sys.argv[1])
    if gen == 1:
        time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)   # newcomer dies after joining
    s = agree_shrink(merged, f"child{gen}")
    print(f"[child{gen}] allreduce={s.allreduce(1)}", flush=True)
    os._exit(0)
rank = comm.Get_rank()
comm.Set_errhandler(MPI.ERRORS_RETURN)
c = comm
for gen in (1, 2):
    t0 = time.time()
    info = MPI.Info.Create(); [info.Set(k, "true") for k in KEYS]; inter = c.Spawn(sys.executable, [__file__, str(gen)], maxprocs=1, info=info, root=0)
    m = inter.Merge(high=False)
    print(f"[{rank}] gen{gen} spawned+merged size {m.Get_size()} {time.time()-t0:.3f}s", flush=True)
    time.sleep(0.6)
    s = agree_shrink(m, f"{rank}")
    print(f"[{rank}] gen{gen} allreduce={s.allreduce(1)}", flush=True)
os._exit(0)
