"""The failure injector: a rank SIGKILLs itself when the loop reaches its scheduled point.

Invariants:
- A rank leaves ONLY by SIGKILL of its own process (feasibility.md: a non-zero ``os._exit`` is not
  seen by ULFM and survivors hang). stdout/stderr and logging handlers are flushed first so the
  last lines of a dying rank reach the log.
- ``check`` is cheap when nothing matches: one dict lookup keyed by (step, location) over this
  rank's own entries (usually none).
- An entry fires at the FIRST time its rank reaches the point in that step; after a kill nothing
  else of the rank runs. Firing an entry always takes its whole replica out (its other ranks leave
  through the replica-consistency gate), which is how survivors can tell, at the end, which
  entries never fired (``unreached``).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable

from recover_hsdp.faults.locations import LOCATIONS, index_field
from recover_hsdp.faults.seam import ENV_ALLOW
from recover_hsdp.faults.schedule import FailureEntry, FailureSchedule

_INDEX_OF = {loc: index_field(loc) for loc in LOCATIONS}


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # a closed or broken stream must not keep a dying rank alive
            pass
    for handler in list(logging.getLogger().handlers):
        try:
            handler.flush()
        except Exception:
            pass


def sigkill_self() -> None:
    """Flush, then SIGKILL this process. Never returns (abort() as a last resort)."""
    _flush_all()
    os.kill(os.getpid(), signal.SIGKILL)
    os.abort()  # unreachable unless SIGKILL delivery was somehow deferred; abort is also seen by ULFM


#: TEST ONLY (with RECOVER_HSDP_ALLOW_TEST_FAULT=1): seconds a rank that found its shard-group
#: mate dead waits, heartbeat beating, before it leaves -- what a rank stuck in an NCCL collective
#: on a dead peer does until the process-group timeout, emulated on gloo (launcher/reaper.py)
ENV_SHARD_WEDGE = "RECOVER_HSDP_TEST_SHARD_WEDGE_S"


def wedge() -> None:
    """The main thread blocks forever; every other thread (the heartbeat) runs on. Only a
    judgement from outside (the launcher's progress watchdog: SIGKILL) ends the process."""
    import threading

    _flush_all()
    while True:
        threading.Event().wait(3600.0)


def replica_lost_exit(reason: str = "", kill: Callable[[], None] | None = None) -> None:
    """How a rank whose replica lost a member leaves: one line on stderr, flush, SIGKILL self.

    Used by the replica-consistency gate (and anywhere a shard-group peer is found dead). Never
    exit with a non-zero status instead: ULFM does not see that as a failure.
    """
    msg = "[recover_hsdp] replica lost a member; this rank leaves by SIGKILL"
    if reason:
        msg += f": {reason}"
    try:
        print(msg, file=sys.stderr, flush=True)
    except Exception:
        pass
    wedge = os.environ.get(ENV_SHARD_WEDGE)
    if wedge and os.environ.get(ENV_ALLOW) == "1":
        time.sleep(float(wedge))   # TEST ONLY: block as an NCCL collective on a dead peer does
    (kill or sigkill_self)()


class FailureInjector:
    """Per-rank view of a schedule.

    ``kill`` replaces the SIGKILL for unit tests (it is called with no arguments and may return,
    in which case the entry is marked fired and never fires again). ``before_kill(entry)`` runs
    just before the kill (e.g. the run record's ``fault_fired`` marker); an exception in it is
    reported and the kill still happens.
    """

    def __init__(self, schedule: FailureSchedule | Iterable[FailureEntry], replica: int,
                 local_rank: int = 0, kill: Callable[[], None] | None = None,
                 before_kill: Callable[[FailureEntry], None] | None = None, verbose: bool = True):
        entries = tuple(schedule.entries if isinstance(schedule, FailureSchedule) else schedule)
        self.schedule_entries: tuple[FailureEntry, ...] = entries
        self.replica = replica
        self.local_rank = local_rank
        self._kill = kill or sigkill_self
        self._before_kill = before_kill
        self._verbose = verbose
        self.fired: list[FailureEntry] = []
        # (step, location) -> [(entry, position in the schedule)]; this rank's entries only
        self._table: dict[tuple[int, str], list[tuple[FailureEntry, int]]] = {}
        for i, e in enumerate(entries):
            if e.replica == replica and e.local_rank == local_rank:
                self._table.setdefault((e.step, e.location), []).append((e, i))

    @property
    def entries(self) -> list[FailureEntry]:
        """This rank's own entries, schedule order."""
        return [e for e in self.schedule_entries
                if e.replica == self.replica and e.local_rank == self.local_rank]

    def check(self, location: str, step: int, microbatch: int | None = None,
              bucket: int | None = None) -> None:
        """Call at every kill point; SIGKILLs this process when a scheduled entry matches.

        forward/backward/extension require ``microbatch``, reduce/re_reduce require ``bucket``,
        the others take neither (a wrong call is a manager bug: ValueError, even with an empty
        schedule, so it is caught by the first test run).
        """
        kind = _INDEX_OF.get(location, "?")
        if kind == "?":
            raise ValueError(f"unknown failure location {location!r} (known: {', '.join(LOCATIONS)})")
        if (microbatch is not None) != (kind == "microbatch") or \
                (bucket is not None) != (kind == "bucket"):
            raise ValueError(f"location {location!r} takes "
                             + (f"a {kind} index" if kind else "no index")
                             + f", got microbatch={microbatch!r} bucket={bucket!r}")
        hits = self._table.get((step, location))
        if not hits:
            return
        for k, (e, i) in enumerate(hits):
            if e.microbatch == microbatch and e.bucket == bucket:
                del hits[k]
                self._fire(e, i)
                return

    def _fire(self, entry: FailureEntry, index: int) -> None:
        self.fired.append(entry)
        if self._verbose:
            try:
                what = "a WEDGE (main thread blocked)" if getattr(entry, "kind", "kill") \
                    == "wedge" else "SIGKILL"
                print(f"[recover_hsdp.faults] injecting {what} at {entry.describe()} "
                      f"(failures.schedule[{index}], pid {os.getpid()})", file=sys.stderr, flush=True)
            except Exception:
                pass
        try:
            if self._before_kill is not None:
                self._before_kill(entry)
        except Exception as e:  # never let bookkeeping keep a scheduled victim alive
            try:
                print(f"[recover_hsdp.faults] before_kill failed: {e!r}", file=sys.stderr, flush=True)
            except Exception:
                pass
        finally:
            if getattr(entry, "kind", "kill") == "wedge":
                wedge()
            self._kill()

    # -- end-of-run accounting -----------------------------------------------------------------
    def unreached(self, final_step: int,
                  alive_replicas: Iterable[int] | None = None) -> list[FailureEntry]:
        """Entries due by ``final_step`` (step <= final_step) that never fired.

        With ``alive_replicas`` (the agreed set alive at the end): every entry of the whole
        schedule whose replica is still alive (firing takes the replica out, so those were never
        reached, e.g. an ``extension`` in a step with no boundary). Without it: this rank's own
        entries only, as seen by this rank.
        """
        if alive_replicas is None:
            return [e for e in self.entries if e.step <= final_step and e not in self.fired]
        alive = set(alive_replicas)
        return [e for e in self.schedule_entries if e.step <= final_step and e.replica in alive]

    def outcome(self, final_step: int, alive_replicas: Iterable[int]) -> dict[str, list[dict]]:
        """{'fired', 'unreached', 'pending'} lists of entry dicts, for the run summary.

        fired: due and its replica is gone (inferred; the dying rank's own marker in the run
        record is the direct evidence); unreached: due but its replica is alive; pending: after
        ``final_step`` (the run ended first).
        """
        alive = set(alive_replicas)
        out: dict[str, list[dict]] = {"fired": [], "unreached": [], "pending": []}
        for e in self.schedule_entries:
            key = "pending" if e.step > final_step else ("unreached" if e.replica in alive
                                                         else "fired")
            out[key].append(e.to_dict())
        return out
