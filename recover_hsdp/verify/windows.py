"""Which steps verify replays and where it compares them, from what the run kept.

No torch here. A run keeps two kinds of parameter state (docs/verify.md, "Verify at scale"):

* parameter snapshots, ``params/`` (record/params.py): the parameters AFTER step s, no
  optimizer state: a comparison point for step s, never a start (AdamW's moments are missing);
* complete DCP checkpoints, ``checkpoints/step_N`` (record/checkpoint.py): the state BEFORE step
  N, i.e. after step N-1 committed, model AND optimizer: a comparison point for step N-1 and a
  start from which steps N, N+1, ... are replayed (``verify/anchors.py`` loads it).

The initial state (``params/init``, or ``build_model(seed)`` with a fresh optimizer) is the start
of step 0. A window ``Window(start, end)`` replays steps start..end (inclusive) from the start
state of ``start`` and compares at every point inside it.

``--steps A:B`` means steps A..B-1 (Python's half-open range; ``A:`` runs to the last step): the
window starts at the nearest start at or before A (steps before A are a lead-in, compared where
they have a point). ``--sample K`` picks K of the windows between consecutive starts (init and
every checkpoint; the last one runs to the final step) that hold at least one point, with
``random.Random(seed)``, and replays each from its start.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

SNAPSHOT, CHECKPOINT = "snapshot", "checkpoint"


@dataclass(frozen=True)
class Window:
    start: int   # first replayed step; its start state: init (0) or checkpoint step_{start}
    end: int     # last replayed step (inclusive)

    def steps(self) -> range:
        return range(self.start, self.end + 1)


def points(last: int, snapshots: Sequence[int], checkpoints: Sequence[int]) -> dict[int, str]:
    """step -> what the replay's parameters after that step are compared with: a snapshot of
    step s, else a checkpoint step_{s+1}. Steps past ``last`` and the init are not points."""
    out = {int(n) - 1: CHECKPOINT for n in checkpoints if 1 <= int(n) <= last + 1}
    out.update({int(s): SNAPSHOT for s in snapshots if 0 <= int(s) <= last})
    return dict(sorted(out.items()))


def starts(last: int, checkpoints: Sequence[int]) -> list[int]:
    """Steps a replay can start at: 0 (the init) and every checkpoint N <= last."""
    return sorted({0} | {int(n) for n in checkpoints if 0 < int(n) <= last})


def parse_steps(text: str, last: int) -> tuple[int, int]:
    """``A:B`` -> (A, B-1) inclusive; ``A:`` -> (A, last); ValueError (one line) otherwise."""
    a, sep, b = str(text).partition(":")
    try:
        first = int(a)
        stop = last + 1 if sep and b.strip() == "" else int(b)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B (steps A..B-1) or A:") from None
    if not sep:
        raise ValueError(f"--steps {text!r}: expected A:B (steps A..B-1) or A:")
    if first < 0 or stop <= first:
        raise ValueError(f"--steps {text!r}: need 0 <= A < B")
    if first > last:
        raise ValueError(f"--steps {text!r}: the run committed steps 0..{last}")
    return first, min(stop - 1, last)


def window_for(first: int, end: int, start_steps: Sequence[int]) -> Window:
    """The window replaying steps first..end from the nearest start at or before ``first``."""
    return Window(max(s for s in start_steps if s <= first), end)


def candidate_windows(last: int, start_steps: Sequence[int],
                      pts: dict[int, str]) -> list[Window]:
    """The windows between consecutive starts (the last to ``last``) holding a point."""
    st = sorted(start_steps)
    out = []
    for i, a in enumerate(st):
        w = Window(a, (st[i + 1] - 1) if i + 1 < len(st) else last)
        if any(s in pts for s in w.steps()):
            out.append(w)
    return out


def sample_windows(cands: Sequence[Window], k: int, seed: int) -> list[Window]:
    """K of ``cands`` (all of them when K >= len), reproducibly from ``seed``, in step order."""
    if k >= len(cands):
        return list(cands)
    return sorted(random.Random(seed).sample(list(cands), k), key=lambda w: w.start)


def plan(last: int, snapshots: Sequence[int], checkpoints: Sequence[int], *,
         steps: Optional[str] = None, sample: Optional[int] = None, seed: int = 0,
         use_checkpoints: bool = True) -> tuple[list[Window], dict[int, str]]:
    """(windows to replay, step -> point kind). Without ``steps``/``sample``: one window of the
    whole run from the init. ``use_checkpoints=False``: snapshots only, every window from init."""
    ckpts = list(checkpoints) if use_checkpoints else []
    pts = points(last, snapshots, ckpts)
    st = starts(last, ckpts)
    if steps is not None:
        first, end = parse_steps(steps, last)
        return [window_for(first, end, st)], pts
    if sample is not None:
        if sample < 1:
            raise ValueError("--sample must be >= 1")
        return sample_windows(candidate_windows(last, st, pts), sample, seed), pts
    return [Window(0, last)], pts


def ranges(steps: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' ('none' when empty)."""
    s = sorted(set(steps))
    if not s:
        return "none"
    out, a, b = [], s[0], s[0]
    for x in s[1:]:
        if x == b + 1:
            b = x
            continue
        out.append(f"{a}" if a == b else f"{a}-{b}")
        a = b = x
    out.append(f"{a}" if a == b else f"{a}-{b}")
    return ", ".join(out)
