"""The verifier's real-process fault seam: make a running trainer commit wrong steps.

TEST ONLY, off by default. ``RECOVER_HSDP_TEST_FAULT="KIND@STEP[:REPLICA]"`` (comma-separated for
several) is honoured by the manager only when ``RECOVER_HSDP_ALLOW_TEST_FAULT=1`` is set too;
`recover-hsdp train` refuses the first without the second (one line, exit 2), and a rank that
sees the first without the second refuses to start. The record is NOT told: it lists exactly
what the policy assigned, so only the replay betrays the fault (`recover-hsdp verify` must
reject the run at STEP; tests/e2e/test_verify_seam.py, tests/e2e/test_verify_divisor.py,
docs/verify.md "Real processes").

Kinds (REPLICA, default 0, applies it on every one of its S shard ranks, in lockstep):

* ``extra_mb``     one microbatch more than recorded: after its first kept microbatch the replica
                   also trains the id its slice would compute next step (a real, unrecorded id)
* ``drop_mb``      its first kept microbatch is computed but left out of the sum (still recorded)
* ``double_mb``    its first kept microbatch is trained twice (counted twice, recorded once)
* ``stale_bucket`` its local shard of bucket 0 (before the cross-replica reduction) is the one of
                   the PREVIOUS step: a bucket reduced from a stale gradient, never rewound

Wrong divisors (``KIND@STEP``, no REPLICA: EVERY rank divides so, at every step from STEP on; of
several, the one with the latest STEP <= the step applies). The record keeps the configured
divisor B (``divisor`` in the step record), as an honest record of what the policy assigned:

* ``live_divisor``   the reduced gradient is divided by the LIVE ``len(alive) x G_init`` (the
                     adaptive policy's divisor, a DDP-style "mean over the world") instead of the
                     fixed B: the same as B until a replica is lost, wrong from the first step
                     that commits with fewer replicas
* ``divisor_plus1``  divided by B + 1
* ``divisor_minus1`` divided by B - 1 (B >= 2)

``RECOVER_HSDP_TEST_NONDET=P`` (same allow variable) is not a fault: it makes the ranks' attention
backward NONDETERMINISTIC, as CUDA's SDPA kernels are (their atomics add in a varying order): each
element of dq, dk and dv moves by one ulp of its dtype, up or down, with probability P each, from
a generator seeded anew in every process. Honest runs with it must still verify (at the tolerance
for a nondeterministic device, docs/verify.md "Nondeterministic devices"), and the four faults
above must still be rejected (tests/e2e/test_verify_nondeterministic.py).

``RECOVER_HSDP_TEST_ENOSPC=N`` (same allow variable) is not a fault of training either: every
checkpoint save of a step >= N fails while writing, as on a full disk (OSError ENOSPC), so a test
sees what a full disk does: the previous checkpoint intact, one line per rank, the run ending
with one line (tests/e2e/test_disk_full.py).

Pure Python: the torch side is recover_hsdp/hsdp/fault_seam.py.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

ENV_FAULT = "RECOVER_HSDP_TEST_FAULT"
ENV_ALLOW = "RECOVER_HSDP_ALLOW_TEST_FAULT"
ENV_GATE = "RECOVER_HSDP_TEST_GATE"   # the test gate (faults/gate.py): same allow variable
ENV_NONDET = "RECOVER_HSDP_TEST_NONDET"   # nondeterministic attention backward: same allow
ENV_ENOSPC = "RECOVER_HSDP_TEST_ENOSPC"   # a full disk from checkpoint step N on: same allow
#: the kinds that change what the trainer computes for ONE replica at ONE step
MICROBATCH_KINDS = ("extra_mb", "drop_mb", "double_mb", "stale_bucket")
#: the kinds that change the divisor of EVERY rank from a step on (wrong_divisor)
DIVISOR_KINDS = ("live_divisor", "divisor_plus1", "divisor_minus1")
KINDS = MICROBATCH_KINDS + DIVISOR_KINDS


class SeamError(ValueError):
    """The seam's environment is malformed or not allowed (one line)."""


@dataclass(frozen=True)
class TestFault:
    kind: str
    step: int
    replica: int = 0


def parse(text: str) -> list[TestFault]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            kind, rest = part.split("@", 1)
            step, _, rep = rest.partition(":")
            f = TestFault(kind.strip(), int(step), int(rep) if rep else 0)
        except ValueError:
            raise SeamError(f"{ENV_FAULT}: {part!r} is not KIND@STEP[:REPLICA]") from None
        if f.kind not in KINDS:
            raise SeamError(f"{ENV_FAULT}: unknown kind {f.kind!r} (one of {', '.join(KINDS)})")
        if f.step < 0 or f.replica < 0:
            raise SeamError(f"{ENV_FAULT}: {part!r}: step and replica must be >= 0")
        if f.kind in DIVISOR_KINDS and rep:
            raise SeamError(f"{ENV_FAULT}: {part!r}: {f.kind} applies on every rank (no :REPLICA)")
        if f.kind == "stale_bucket" and f.step < 1:
            raise SeamError(f"{ENV_FAULT}: {part!r}: stale_bucket needs a previous step (>= 1)")
        out.append(f)
    return out


def wrong_divisor(faults: list[TestFault], step: int, divisor: int, alive: int,
                  g_init: int) -> int:
    """The divisor the trainer applies at ``step`` under the divisor kinds among ``faults``
    (``divisor``, the configured one, when none has started): the kind with the latest STEP <=
    ``step`` decides. ``alive``: the replicas the step commits with; ``g_init``: G_init."""
    started = [f for f in faults if f.kind in DIVISOR_KINDS and f.step <= step]
    if not started:
        return divisor
    kind = max(started, key=lambda f: f.step).kind
    if kind == "live_divisor":
        return alive * g_init
    return divisor + 1 if kind == "divisor_plus1" else max(1, divisor - 1)


def refusal(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """None when the seam is off or explicitly allowed; else the one-line reason to refuse."""
    env = os.environ if env is None else env
    if env.get(ENV_GATE) and env.get(ENV_ALLOW) != "1":
        return (f"{ENV_GATE} is set: a test-only gate that holds training at a step; unset it "
                f"(tests also set {ENV_ALLOW}=1)")
    if env.get(ENV_NONDET):
        if env.get(ENV_ALLOW) != "1":
            return (f"{ENV_NONDET} is set: a test-only seam that makes the attention backward "
                    f"nondeterministic; unset it (tests also set {ENV_ALLOW}=1)")
        try:
            nondet_probability(env)
        except SeamError as e:
            return str(e)
    if env.get(ENV_ENOSPC):
        if env.get(ENV_ALLOW) != "1":
            return (f"{ENV_ENOSPC} is set: a test-only seam that makes checkpoint saves fail "
                    f"with ENOSPC; unset it (tests also set {ENV_ALLOW}=1)")
        if not env[ENV_ENOSPC].isdigit():
            return f"{ENV_ENOSPC}={env[ENV_ENOSPC]!r}: expected a step (an integer >= 0)"
    if not env.get(ENV_FAULT):
        return None
    if env.get(ENV_ALLOW) != "1":
        return (f"{ENV_FAULT} is set: a test-only seam that makes training commit WRONG steps; "
                f"unset it (tests also set {ENV_ALLOW}=1)")
    try:
        parse(env[ENV_FAULT])
    except SeamError as e:
        return str(e)
    return None


def nondet_probability(env: Optional[Mapping[str, str]] = None) -> float:
    """RECOVER_HSDP_TEST_NONDET as a probability in (0, 0.5] (0.0 when unset)."""
    env = os.environ if env is None else env
    text = env.get(ENV_NONDET, "")
    if not text:
        return 0.0
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0.0 < p <= 0.5:
        raise SeamError(f"{ENV_NONDET}={text!r}: expected a probability in (0, 0.5]")
    return p


def enospc_step(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """RECOVER_HSDP_TEST_ENOSPC (allowed): every checkpoint save of a step >= this one fails
    as on a full disk (OSError ENOSPC while writing); None when off."""
    env = os.environ if env is None else env
    text = env.get(ENV_ENOSPC, "")
    return int(text) if text.isdigit() and env.get(ENV_ALLOW) == "1" else None


def from_env(env: Optional[Mapping[str, str]] = None) -> list[TestFault]:
    """The faults to inject ([] when the seam is off); SeamError when set but not allowed."""
    env = os.environ if env is None else env
    why = refusal(env)
    if why:
        raise SeamError(why)
    return parse(env.get(ENV_FAULT, ""))


def enospc_writer(save: Callable, step: int) -> Callable:
    """``save`` (dcp.save), or, under the test seam RECOVER_HSDP_TEST_ENOSPC (faults/seam.py),
    a writer that fails as on a full disk for a step at or past the seam's."""
    at = enospc_step()
    if at is None or step < at:
        return save

    def full(state, checkpoint_id, process_group=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                      os.path.join(str(checkpoint_id), "__0_0.distcp"))
    return full
