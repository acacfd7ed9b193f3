"""A private one-node Slurm on this machine, for the test of launch/slurm.sbatch.

    with one_node_slurm(deadline) as slurm:          # or the `slurm` fixture of a test module
        job = slurm.sbatch(["launch/slurm.sbatch", ...], env=env, dl=deadline)
        state = slurm.wait_job(job, deadline, done=lambda j: j["JobState"] == "COMPLETED")

Everything is its own: munged with its own key and socket, slurmctld and slurmd with a slurm.conf
generated in a short temporary directory (state, spool, logs and pid files under it; ports chosen
free; NodeName = this host's short hostname; no cgroups, no accounting). The clients (sbatch,
scontrol, scancel, sinfo) find it through SLURM_CONF in the environment they are given
(:meth:`Slurm.env`), and so do the jobs (sbatch exports the submitter's environment, the test id
included: tests/_procs.py). The daemons run in the foreground as this test's children; teardown
SIGKILLs every process whose environment names this cluster's slurm.conf (the daemons, a
slurmstepd, a job's leftovers) and waits for each death (pidfd).

The packages (slurm-wlm, munge) are installed by a set-up step of .ci/run, not here. Where Slurm
is expected (CI=1: CI runs as root on a machine like this) a missing package or a cluster that
does not come up FAILS with one line; elsewhere it SKIPS with one line.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from tests._wait import Deadline, until, wait_dead

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo")
#: how long the three daemons may take to bring the node to idle (a quiet box: ~2-5 s)
START_S = 60.0


def _which(name: str) -> str | None:
    """``name`` on PATH, or in the sbin directories a non-login root PATH may lack."""
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _fail_or_skip(msg: str) -> None:
    if os.environ.get("CI") == "1":
        pytest.fail(f"Slurm (CI=1): {msg}", pytrace=False)
    pytest.skip(f"Slurm: {msg}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpus() -> int:
    """What slurmd reports for this machine (CPUs=N of `slurmd -C`), else os.cpu_count()."""
    try:
        out = subprocess.run([_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
        return int(out.split("CPUs=")[1].split()[0])
    except (OSError, IndexError, ValueError):   # a hung slurmd (TimeoutExpired) fails the test
        return os.cpu_count() or 1


#: the fewest CPUs the node offers: a 2-core CI box runs 3 ranks (oversubscribed, as every e2e
#: test does); slurmd takes the configured count (SlurmdParameters=config_overrides)
NODE_CPUS = 4


def slurm_conf(root: Path, host: str, ctld_port: int, slurmd_port: int, cpus: int) -> str:
    return "\n".join([
        "ClusterName=rhsdptest",
        f"SlurmctldHost={host}",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.sock",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"PlugStackConfig={root}/plugstack.conf",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "MinJobAge=600",
        "KillWait=5",
        "InactiveLimit=0",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        ""])


@dataclass
class Slurm:
    root: Path
    conf: Path
    host: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self, base: dict | None = None) -> dict:
        """An environment whose Slurm clients (and jobs) talk to this cluster."""
        e = dict(os.environ if base is None else base)
        e["SLURM_CONF"] = str(self.conf)
        for k in [k for k in e if k.startswith(("SBATCH_", "SLURM_")) and k != "SLURM_CONF"]:
            del e[k]
        return e

    def cli(self, args: Sequence[str], dl: Deadline, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        from tests._procs import run

        p = run(list(args), timeout=min(60.0, dl.left()), capture_output=True, text=True,
                env=self.env(env))
        if check and p.returncode != 0:
            raise AssertionError(f"`{' '.join(map(str, args))}` exit {p.returncode}: "
                                 f"{(p.stderr or p.stdout).strip()[-2000:]}\n{self.logs()}")
        return p

    def sbatch(self, args: Sequence[str], dl: Deadline, env: dict | None = None,
               cwd: Path | None = None) -> int:
        from tests._procs import run

        p = run(["sbatch", "--parsable", *map(str, args)], timeout=min(60.0, dl.left()),
                capture_output=True, text=True, env=self.env(env), cwd=cwd)
        assert p.returncode == 0, f"sbatch exit {p.returncode}: {p.stderr.strip()}"
        return int(p.stdout.strip().split(";")[0])

    def job(self, job_id: int, dl: Deadline) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.cli(["scontrol", "-o", "show", "job", str(job_id)], dl).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: int, dl: Deadline, done: Callable[[dict], bool], what: str,
                 detail: Callable[[], str] | None = None) -> dict:
        """Poll the job's state until ``done(state)`` (the job's own event, read from the
        controller; the poll period only paces)."""
        last: dict = {}

        def check():
            last.clear()
            last.update(self.job(job_id, dl))
            return dict(last) if done(last) else None

        return until(check, dl, what, alive=self.alive,
                     detail=lambda: f"job {last}\n{self.logs()}"
                     + (f"\n{detail()}" if detail else ""))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def logs(self, n: int = 15) -> str:
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            f = self.root / name
            if f.exists():
                tail = f.read_text(errors="replace").splitlines()[-n:]
                out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)

    def kill_all(self, dl: Deadline) -> None:
        """SIGKILL every process of this cluster (its SLURM_CONF in the environment), wait."""
        want = f"SLURM_CONF={self.conf}".encode()
        for _ in range(20):
            pids = [p for p in _pids_with(want) if p != os.getpid()]
            for p in self.procs.values():
                if p.poll() is None:
                    pids.append(p.pid)
            if not pids:
                break
            for pid in set(pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in set(pids):
                wait_dead(pid, dl.sub(10), f"Slurm process {pid}")
        for p in self.procs.values():
            p.wait(timeout=10)


def _pids_with(want: bytes) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        out.append(int(d))
            except OSError:
                pass
    return out


def _start(slurm: Slurm, name: str, cmd: list[str], env: dict) -> None:
    log = open(slurm.root / f"{name}.out", "wb")
    slurm.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()


@contextlib.contextmanager
def one_node_slurm(dl: Deadline) -> Iterator[Slurm]:
    missing = [b for b in DAEMONS + CLIENTS if _which(b) is None]
    if missing:
        _fail_or_skip(f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge; "
                      f".ci/run does it)")
    if os.geteuid() != 0:
        _fail_or_skip("the private cluster runs its daemons as root (not root here)")
    host = socket.gethostname().split(".")[0]
    # short: munged's socket and slurmd's step sockets must fit sun_path (108 bytes)
    root = Path(tempfile.mkdtemp(prefix="rhsdp-slurm-"))
    slurm = Slurm(root=root, conf=root / "slurm.conf", host=host)
    try:
        for d in ("state", "spool"):
            (root / d).mkdir()
        (root / "plugstack.conf").write_text("")
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        slurm.conf.write_text(slurm_conf(root, host, _free_port(), _free_port(),
                                          max(NODE_CPUS, _cpus())))
        env = slurm.env()
        _start(slurm, "munged", [_which("munged"), "-F", "--force", f"--socket={root}/munge.sock",
                                 f"--key-file={key}", f"--pid-file={root}/munged.pid",
                                 f"--log-file={root}/munged.log",
                                 f"--seed-file={root}/munged.seed"], env)
        until(lambda: (root / "munge.sock").exists(), dl.sub(START_S), "munged's socket",
              alive=slurm.alive, detail=slurm.logs)
        _start(slurm, "slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(slurm.conf)], env)
        _start(slurm, "slurmd", [_which("slurmd"), "-D", "-f", str(slurm.conf), "-N", host], env)
        sub = dl.sub(START_S)

        def idle():
            p = slurm.cli(["sinfo", "-h", "-n", host, "-o", "%T"], sub, check=False)
            return p.returncode == 0 and p.stdout.strip() == "idle"

        try:
            until(idle, sub, f"node {host} idle", alive=slurm.alive)
        except AssertionError as e:
            tail = [ln for ln in slurm.logs(3).splitlines() if ln.strip()][-1:]
            _fail_or_skip(f"the one-node cluster did not come up ({str(e).splitlines()[0]}; "
                          f"{tail[0] if tail else 'no log'}; RECOVER_HSDP_KEEP_SLURM=1 keeps {root})")
        yield slurm
    finally:
        slurm.kill_all(Deadline(60))
        if not os.environ.get("RECOVER_HSDP_KEEP_SLURM"):
            shutil.rmtree(root, ignore_errors=True)
