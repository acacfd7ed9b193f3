"""Before a launch: is the mpirun we are about to run there, and is it an Open MPI with ULFM?

A missing mpirun used to surface as ``[Errno 2] No such file or directory: 'mpirun'`` after the
store was up, and an mpirun without ULFM as mpirun's own complaint about ``--with-ft``. Both are
now one line naming the mpirun, what is wrong and the command that installs a working one, and
exit code ``exit_codes.UNAVAILABLE`` (5), for `recover-hsdp train` and `recover-hsdp launch`.
(A path the user named that is not there, ``run.mpirun=/typo`` or ``MPIRUN=/typo``, is a usage
error, 2, naming the key, checked before this.)

ULFM is in every Open MPI >= 5.0 build by default (``--with-ft ulfm`` at run time); the check is
``mpirun --version`` (about 10 ms): it must say "Open MPI" and a major version >= 5.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Optional

from recover_hsdp.exit_codes import INSTALL_MPI

#: how long ``mpirun --version`` may take (it starts no daemon)
VERSION_TIMEOUT_S = 30.0


def mpirun_problem(mpirun: str, *, ulfm: bool = True, chosen_by: str = "PATH") -> Optional[str]:
    """None if ``mpirun`` can launch a job here (with ULFM when ``ulfm``), else one line why.
    ``chosen_by``: how the user picks another (``run.mpirun``, ``MPIRUN``), named in the line."""
    path = mpirun if os.sep in mpirun else shutil.which(mpirun)
    fix = f"install Open MPI 5 with ULFM: {INSTALL_MPI}"
    if not path or not os.path.isfile(path):
        return (f"MPI not found: no mpirun {mpirun!r} (chosen by {chosen_by}, else the one next "
                f"to this Python, else PATH); {fix}")
    if not os.access(path, os.X_OK):
        return f"MPI not usable: {path} is not executable; {fix}"
    if not ulfm:
        return None
    try:
        p = subprocess.run([path, "--version"], capture_output=True, text=True,
                           timeout=VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL)
        text = p.stdout + p.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"MPI not usable: `{path} --version` failed ({' '.join(str(e).split())}); {fix}"
    m = re.search(r"Open MPI\)?\s+v?(\d+)\.(\d+)", text)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "no output")
    if not m:
        return f"MPI without ULFM: {path} is not Open MPI ({first!r}); {fix}"
    if int(m.group(1)) < 5:
        return (f"MPI without ULFM: {path} is Open MPI {m.group(1)}.{m.group(2)} "
                f"(ULFM needs >= 5.0); {fix}")
    return None
