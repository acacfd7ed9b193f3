"""RECOVER_HSDP_WORKER_FN seam for tests: the real trainer with a loss that raises.

RAISE_RANKS: "all" or comma-separated global ranks; RAISE_CALL: the loss raises from its
(RAISE_CALL+1)-th call on (G calls per step); RAISE_CLASS: ValueError (default) or FileNotFoundError.
"""
from __future__ import annotations

import os


def run_worker(cfg):
    import recover_hsdp.model as M

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    who = os.environ.get("RAISE_RANKS", "")
    at = int(os.environ.get("RAISE_CALL", "6"))
    cls = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}[
        os.environ.get("RAISE_CLASS", "ValueError")]
    if who == "all" or str(rank) in who.split(","):
        orig = M.next_token_loss
        n = [0]

        def bad(*a, **k):
            n[0] += 1
            if n[0] > at:
                raise cls(f"injected error in the loss (call {n[0]})")
            return orig(*a, **k)

        M.next_token_loss = bad
    from recover_hsdp.workers.resilient import run_worker as real

    return real(cfg)
