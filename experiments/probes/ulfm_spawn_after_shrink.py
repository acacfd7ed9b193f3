"""Probe: can survivors MPI_Comm_spawn a newcomer after a ULFM shrink and merge it?

    mpirun --with-ft ulfm --oversubscribe -n 4 python experiments/probes/ulfm_spawn_after_shrink.py

Rank 2 SIGKILLs itself; the others revoke + shrink (4 -> 3), spawn one process, merge, allreduce.
Seen 2026-11-30 (Open MPI 5.0.11): works; shrink 2-12 ms, spawn 1.18 s, merged allreduce = 4.
"""
import os, sys, signal, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
parent = MPI.Comm.Get_parent()
if parent != MPI.COMM_NULL:
    # newcomer
    t0=time.time()
    inter = parent
    merged = inter.Merge(high=True)
    print(f"[child] merged size={merged.Get_size()} rank={merged.Get_rank()} in {time.time()-t0:.3f}s", flush=True)
    x = merged.allreduce(1)
    print(f"[child] allreduce={x}", flush=True)
    sys.stdout.flush(); os._exit(0)
rank = comm.Get_rank()
comm.Set_errhandler(MPI.ERRORS_RETURN)
if rank == 2:
    time.sleep(0.2); os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5)
try:
    comm.Barrier()
except MPI.Exception as e:
    print(f"[{rank}] barrier failed: {e.Get_error_class()}", flush=True)
comm.Revoke() if hasattr(comm,'Revoke') else None
t0=time.time()
sh = comm.Shrink()
print(f"[{rank}] shrunk to {sh.Get_size()} in {time.time()-t0:.3f}s", flush=True)
t0=time.time()
inter = sh.Spawn(sys.executable, [__file__], maxprocs=1, root=0)
print(f"[{rank}] spawned in {time.time()-t0:.3f}s", flush=True)
merged = inter.Merge(high=False)
print(f"[{rank}] merged size={merged.Get_size()}", flush=True)
x = merged.allreduce(1)
print(f"[{rank}] allreduce={x}", flush=True)
sys.stdout.flush(); os._exit(0)
