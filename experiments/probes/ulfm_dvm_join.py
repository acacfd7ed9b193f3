"""Probe: a newcomer started as a SEPARATE job joins a running ULFM job through a
persistent PRRTE DVM (MPI_Open_port / Accept <- Connect, then Intercomm_merge), and what a
failure does. See experiments/probes/ulfm_dvm_run.sh for the commands (it starts its own DVM).

Roles (argv[1]): A = the running job (3 ranks), B = the newcomer (1 rank), solo = job A alone
with rank 2 SIGKILLed (is ULFM live on a DVM job at all?). Scenario in $SCEN:
  ok  B connects, merge, allreduce on 4, both sides exit clean
  a   B SIGKILLs itself 0.5 s after the merge; A must revoke + shrink the merged comm and go on
  b   A's rank 2 SIGKILLs itself while A is in Accept (B connects 1 s later)
  c   B SIGKILLs itself while blocked in Connect (A only accepts 2 s after the port is out)
  c2  A accepts at once; B SIGKILLs itself 1 s after reading the port, never calling Connect
      (does a blocked Accept ever return? try OMPI_MCA_mpi_pmix_connect_timeout)
  d   A's rank 2 SIGKILLs itself 0.5 s after the merge; A0, A1 and B must shrink to 3 and go on
  e   A's rank 2 dies BEFORE the join; A's survivors shrink their world to 2 and accept B on
      the shrunk comm (the order a rejoin would use): merged size 3
  i   roles inverted: B (the newcomer) opens the port and Accepts, A's ranks Connect
  ic  as i, but B SIGKILLs itself 1 s after publishing, before A connects (A waits 2 s)
  im  as i, but A's rank 2 enters Connect 2 s late and B SIGKILLs itself 1 s into its Accept,
      while A0/A1 and B wait inside the connect for A2
  dvm (role solo, nobody killed, 40 rounds): the driver SIGKILLs the DVM (prte) 4 s in
  a2  as a, then A (on the shrunk merged comm) accepts a SECOND newcomer (B with SCEN=ok and
      PORT_FILE=$PORT_FILE.2): a second join cycle
Every rank prints `[role rank] what t=... at=...` lines (at = wall clock mod 1000, to line up
the two jobs); the run script's `timeout` bounds every wait.

    bash experiments/probes/ulfm_dvm_run.sh solo ok a b c c2 d e i ic im a2

Seen 2026-12-01 (Open MPI 5.0.11 / PRRTE 3.0.14 from PyPI, 2 cores, load 15-19):
  solo  rank 2 killed: ranks 0, 1 get ERR_PROC_FAILED (75), revoke, shrink -> 2, go on, rc 0;
        with EXTRA=OMPI_MCA_mpi_ft_enable=0 (what `--with-ft ulfm` alone gives a DVM job) the
        survivors hang silently for the whole 25 s box
  ok    connect 0.01-0.04 s, merge 0.01-0.05 s, allreduce = 4 on both sides, both rc 0
  a     A's ranks get 75 / ERR_REVOKED (77) 7-37 ms after B's kill, shrink -> 3 in 1-7 ms,
        allreduce = 3, A exits 0: the DVM does NOT kill job A
  b     HANG: A1 gets 75 from Accept, A0 (root) and B block in PMIx_Connect forever (gdb), A1
        in shrink; OMPI_MCA_mpi_pmix_connect_timeout=5 changes nothing; killing the two
        mpiruns leaves the hung processes alive under the DVM (killed by pid)
  c     A's Accept (2 s later) fails at once with ERR_INTERN (17) "Underlying runtime
        environment does not support accept/connect"; A's world is intact
  c2    HANG: A0 blocks in Accept for the whole 40 s box (with or without the timeout param)
  d     A0, A1 AND B get 77/75 ~25 ms after A2's kill, shrink -> 3, allreduce = 3, all rc 0
  e     survivors shrink their world to 2, accept B on it: merged size 3, allreduce = 3
  i     inverted roles work the same (connect 0.01-0.2 s)
  ic    A's Connect fails at once (ERR_INTERN, 0.02 s); A's world intact, allreduce = 3
  im    HANG: A0/A1 (in Connect) and the DVM job stay blocked for the 40 s box
  dvm   SIGKILL of prte ends the job: its ranks are gone at once (last round printed 0.8 s in,
        none left 4 s later), mpirun rc 195: the DVM is a single point of failure
  a2    after B1's death and the shrink, a second Accept on the shrunk merged comm takes B2:
        merged size 4 again, allreduce = 4
"""
import os, sys, time, signal, threading
from mpi4py import MPI
import numpy as np

role = sys.argv[1]
scen = os.environ.get("SCEN", "ok")
pf = os.environ["PORT_FILE"]
if role == "B" and sys.argv[2:] == ["PORT2"]:   # the second newcomer of scenario a2
    pf += ".2"
comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank = comm.Get_rank()
T0 = time.time()


def say(msg):
    now = time.time()
    print(f"[{role}{rank}] {msg} t={now - T0:.3f} at={now % 1000:.3f}", flush=True)


def die_in(sec):
    def kill():
        say("SIGKILL self")
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Timer(sec, kill).start()


def repair(c, tag):
    """Revoke + shrink c after a failure; returns the shrunk comm."""
    t = time.time()
    try:
        c.Revoke()
        say(f"{tag}: revoked in {time.time() - t:.3f}s")
    except MPI.Exception as e:
        say(f"{tag}: revoke raised class {e.Get_error_class()}")
    s = c.Shrink()
    s.Set_errhandler(MPI.ERRORS_RETURN)
    say(f"{tag}: shrink -> {s.Get_size()} in {time.time() - t:.3f}s")
    return s


def allreduce(c):
    """Sum of 1 over c with MPI_Allreduce ON c (mpi4py's lowercase allreduce runs point-to-point
    on an internal duplicate that a Revoke of c does not reach)."""
    out = np.zeros(1, dtype=np.int64)
    c.Allreduce(np.ones(1, dtype=np.int64), out)
    return int(out[0])


def keep_going(c, tag, rounds=6):
    """Allreduce rounds on c; on a failure repair and go on. Returns the last comm."""
    for i in range(rounds):
        try:
            v = allreduce(c)
            say(f"{tag}: round {i} allreduce={v}")
        except MPI.Exception as e:
            say(f"{tag}: round {i} failed class {e.Get_error_class()}")
            c = repair(c, tag)
        time.sleep(0.25)
    return c


if role == "solo":
    if rank == 2 and scen != "dvm":
        die_in(0.5)
    keep_going(comm, "solo", rounds=40 if scen == "dvm" else 6)
    say("solo done, exiting 0")
    os._exit(0)

def wait_port():
    t = time.time()
    while not os.path.exists(pf):
        time.sleep(0.02)
        if time.time() - t > 30:
            say("no port file in 30 s")
            os._exit(3)
    return open(pf).read()


if scen in ("i", "ic", "im"):     # inverted: the newcomer accepts, the running job connects
    if role == "B":
        port = MPI.Open_port()
        with open(pf + ".tmp", "w") as f:
            f.write(port)
        os.rename(pf + ".tmp", pf)
        say("port published")
        if scen in ("ic", "im"):
            die_in(1.0)
        t = time.time()
        inter = comm.Accept(port, root=0)
        say(f"accepted in {time.time() - t:.3f}s")
        m = inter.Merge(high=True)
        m.Set_errhandler(MPI.ERRORS_RETURN)
        say(f"merged size {m.Get_size()}")
        keep_going(m, "B-merged")
    else:
        port = wait_port() if rank == 0 else None
        if scen == "ic" or (scen == "im" and rank == 2):
            time.sleep(2.0)
        t = time.time()
        try:
            inter = comm.Connect(port, root=0)
        except MPI.Exception as e:
            say(f"Connect failed class {e.Get_error_class()} after {time.time() - t:.3f}s")
            say(f"A-world still fine: allreduce={allreduce(comm)}")
            os._exit(0)
        say(f"connected in {time.time() - t:.3f}s")
        m = inter.Merge(high=False)
        m.Set_errhandler(MPI.ERRORS_RETURN)
        say(f"merged size {m.Get_size()}")
        keep_going(m, "A-merged")
    say("done, exiting 0")
    os._exit(0)

if role == "A":
    port = None
    if scen == "e":
        if rank == 2:
            say("SIGKILL self")
            os.kill(os.getpid(), signal.SIGKILL)
        comm = keep_going(comm, "A-world", rounds=1)   # sees the death, revokes, shrinks
        if allreduce(comm) != 2:
            say("expected 2 survivors")
            os._exit(4)
        rank = comm.Get_rank()
    if rank == 0:
        port = MPI.Open_port()
        with open(pf + ".tmp", "w") as f:
            f.write(port)
        os.rename(pf + ".tmp", pf)
        say(f"port published {port[:40]}...")
        if scen == "c":
            time.sleep(2.0)
    if scen == "b" and rank == 2:
        die_in(0.5)
    t = time.time()
    try:
        inter = comm.Accept(port, root=0)
    except MPI.Exception as e:
        say(f"Accept failed class {e.Get_error_class()} after {time.time() - t:.3f}s")
        s = repair(comm, "A-world")
        say(f"A-world after failed accept: allreduce={allreduce(s)}")
        os._exit(0)
    say(f"accepted in {time.time() - t:.3f}s, remote size {inter.Get_remote_size()}")
    t = time.time()
    m = inter.Merge(high=False)
    m.Set_errhandler(MPI.ERRORS_RETURN)
    say(f"merged size {m.Get_size()} in {time.time() - t:.3f}s pid {os.getpid()}")
    if scen == "d" and rank == 2:
        die_in(0.5)
    c = keep_going(m, "A-merged")
    if scen == "a2":
        port2 = None
        if c.Get_rank() == 0:
            port2 = MPI.Open_port()
            with open(pf + ".2.tmp", "w") as f:
                f.write(port2)
            os.rename(pf + ".2.tmp", pf + ".2")
            say("second port published")
        t = time.time()
        inter = c.Accept(port2, root=0)
        say(f"second accept in {time.time() - t:.3f}s")
        t = time.time()
        m2 = inter.Merge(high=False)
        m2.Set_errhandler(MPI.ERRORS_RETURN)
        say(f"second merge size {m2.Get_size()} in {time.time() - t:.3f}s")
        keep_going(m2, "A-merged2")
    say("A done, exiting 0")
    os._exit(0)

if role == "B":
    port = wait_port()
    if scen == "b":
        time.sleep(1.0)
    if scen == "c":
        die_in(1.0)
    if scen == "c2":
        die_in(1.0)
        time.sleep(30)
    t = time.time()
    inter = MPI.COMM_WORLD.Connect(port, root=0)
    say(f"connected in {time.time() - t:.3f}s")
    t = time.time()
    m = inter.Merge(high=True)
    m.Set_errhandler(MPI.ERRORS_RETURN)
    say(f"merged size {m.Get_size()} rank {m.Get_rank()} in {time.time() - t:.3f}s")
    if scen == "a":
        die_in(0.5)
    keep_going(m, "B-merged")
    say("B done, exiting 0")
    os._exit(0)
