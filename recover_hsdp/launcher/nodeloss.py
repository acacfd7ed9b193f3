"""A whole node lost (its ranks AND its Open MPI daemon): recognise it, plan the restart.

Open MPI 5.0.11 cannot survive a lost daemon: PRTE prints "PRTE has lost communication with a
remote daemon" and ends the WHOLE job (ompi #12227; PRRTE PR #2443 adds daemon-loss tolerance
but is newer than the PRRTE 5.0.11 bundles). ULFM never gets a say. So node loss is turned into
the shortest restart there is (docs/faults.md "Node loss"): the launcher reads mpirun's output,
names the lost node, and relaunches the survivors from the newest complete checkpoint on the
hostfile minus that node, at the widest W' that fits and divides B (G' = B / W', so every step
still sums exactly B microbatches), if ``run.max_restarts`` allows.

Pure functions: the launcher (recover_hsdp/launcher/resume.py) does the I/O.
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

#: what mpirun (PRTE) prints when a remote daemon is gone (lower-case substrings)
LOST_DAEMON = ("lost communication with a remote daemon", "lost connection to a remote daemon")
_REMOTE = re.compile(r"remote daemon\s*:\s*\[[^\]]*?(?:,(\d+))?\]\s+on\s+node\s+(\S+)",
                     re.IGNORECASE)
HOSTFILE_FLAGS = ("--hostfile", "-hostfile", "--machinefile", "-machinefile")


def lost_node(output: str) -> Optional[str]:
    """None: no daemon was lost; else the lost node's name as PRTE printed it ("" if unnamed)."""
    low = output.lower()
    if not any(p in low for p in LOST_DAEMON):
        return None
    m = _REMOTE.search(output)
    return m.group(2).strip(".,;") if m else ""


def lost_daemon_vpid(output: str) -> Optional[int]:
    """The lost daemon's PRTE vpid ("[prterun-...@0,1]" -> 1), None if not printed."""
    m = _REMOTE.search(output)
    return int(m.group(1)) if m and m.group(1) else None


def _is_local(name: str) -> bool:
    """``name`` is this machine: its hostname, or an address this process can bind."""
    if name.split(".")[0] == socket.gethostname().split(".")[0]:
        return True
    for addr in _addrs(name):
        try:
            with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
                s.bind((addr, 0))
            return True
        except OSError:
            continue
    return False


def host_of_vpid(hosts: Sequence[tuple[str, int]], vpid: int) -> Optional[str]:
    """The hostfile entry PRTE gave daemon ``vpid``: vpid 0 is mpirun's own node (the HNP), the
    others follow in hostfile order, the HNP's node skipped. For node names that do not match
    the hostfile (PRTE prints the node's hostname, the hostfile may hold addresses)."""
    names = [h for h, _ in hosts]
    hnp = next((h for h in names if _is_local(h)), None)
    order = ([hnp] if hnp else [None]) + [h for h in names if h != hnp]
    return order[vpid] if 0 < vpid < len(order) else None


def parse_hostfile(text: str) -> list[tuple[str, int]]:
    """``host [slots=N] [max_slots=M]`` lines (comments, blank lines skipped); slots default 1."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = 1
        for p in parts[1:]:
            k, _, v = p.partition("=")
            if k == "slots" and v.isdigit():
                slots = int(v)
        out.append((parts[0], slots))
    return out


def hostfile_in(args: Sequence[str]) -> Optional[tuple[int, str]]:
    """(index of the path in ``args``, path) of ``--hostfile PATH`` (or -machinefile ...)."""
    for i, a in enumerate(args):
        if a in HOSTFILE_FLAGS and i + 1 < len(args):
            return i + 1, args[i + 1]
        for f in HOSTFILE_FLAGS:
            if a.startswith(f + "="):
                return i, a.split("=", 1)[1]
    return None


def _addrs(name: str) -> set[str]:
    try:
        return {i[4][0] for i in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError):
        return set()


def same_host(a: str, b: str) -> bool:
    """Same name (or short name), or the two resolve to a common address."""
    if a == b or a.split(".")[0] == b.split(".")[0]:
        return True
    return bool(_addrs(a) & _addrs(b))


@dataclass(frozen=True)
class RelaunchPlan:
    hosts: tuple[tuple[str, int], ...]   # the hostfile without the lost node
    replicas: int                        # W'
    grad_accum: int                      # G' = B / W'
    lost: str

    def hostfile_text(self) -> str:
        return "".join(f"{h} slots={s}\n" for h, s in self.hosts)


def plan_after_node_loss(hosts: Sequence[tuple[str, int]], lost: str, replicas: int,
                         shard_size: int, grad_accum: int, vpid: Optional[int] = None
                         ) -> tuple[Optional[RelaunchPlan], str]:
    """(plan, "") or (None, why not). The lost node is matched by name, else by its daemon's
    vpid (:func:`host_of_vpid`). W' = the largest divisor of B = W x G that is <= W and fits
    the remaining hosts with a replica's S ranks on one node (sum of slots // S)."""
    if not lost and vpid is None:
        return None, "PRTE did not name the lost node"
    left = tuple((h, s) for h, s in hosts if lost and not same_host(h, lost))
    if len(left) == len(hosts) or not lost:
        by_vpid = host_of_vpid(hosts, vpid) if vpid is not None else None
        if by_vpid is None:
            return None, f"the lost node {lost!r} is not in the hostfile"
        left = tuple((h, s) for h, s in hosts if h != by_vpid)
        lost = f"{lost} = {by_vpid}" if lost else by_vpid
    fit = sum(s // shard_size for _, s in left)
    B = replicas * grad_accum
    w = max((d for d in range(1, min(replicas, fit) + 1) if B % d == 0), default=0)
    if w < 1:
        return None, (f"the remaining hosts ({', '.join(h for h, _ in left) or 'none'}) hold no "
                      f"replica of parallel.shard_size={shard_size} ranks")
    return RelaunchPlan(left, w, B // w, lost), ""


def relaunch_args(args: Sequence[str], hostfile: Path) -> list[str]:
    """``run.mpirun_args`` with the hostfile replaced by ``hostfile``."""
    out = list(args)
    found = hostfile_in(out)
    if found is None:
        return out
    i = found[0]
    inline = any(out[i].startswith(f + "=") for f in HOSTFILE_FLAGS)
    out[i] = out[i].split("=", 1)[0] + "=" + str(hostfile) if inline else str(hostfile)
    return out
