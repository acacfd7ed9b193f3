"""Probe, server half: accept a newcomer from a SEPARATE mpirun (connect/accept).

    mpirun --with-ft ulfm --oversubscribe -n 3 python experiments/probes/ulfm_accept.py &
    mpirun --with-ft ulfm --oversubscribe -n 1 python experiments/probes/ulfm_connect.py

Seen 2026-11-30 (Open MPI 5.0.11, two independent mpiruns, no shared PRRTE DVM / ompi-server):
Accept/Connect never complete (both time out at 30-40 s).
"""
import os, sys, time, signal
from mpi4py import MPI
comm = MPI.COMM_WORLD; rank = comm.Get_rank()
comm.Set_errhandler(MPI.ERRORS_RETURN)
port = MPI.Open_port() if rank == 0 else None
if rank == 0:
    open(os.environ.get("PORT_DIR", "/tmp") + "/port.txt.tmp","w").write(port); os.rename(os.environ.get("PORT_DIR", "/tmp") + "/port.txt.tmp",os.environ.get("PORT_DIR", "/tmp") + "/port.txt")
t0=time.time()
inter = comm.Accept(port, root=0)
m = inter.Merge(high=False); m.Set_errhandler(MPI.ERRORS_RETURN)
print(f"[srv{rank}] accepted+merged size {m.Get_size()} {time.time()-t0:.2f}s", flush=True)
time.sleep(1.0)
try:
    m.Barrier(); print(f"[srv{rank}] barrier ok", flush=True)
except MPI.Exception as e:
    print(f"[srv{rank}] barrier failed {e.Get_error_class()}", flush=True)
    m.Revoke(); s = m.Shrink(); print(f"[srv{rank}] shrunk {s.Get_size()} allreduce={s.allreduce(1)}", flush=True)
os._exit(0)
