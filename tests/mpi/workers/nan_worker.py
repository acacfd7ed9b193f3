"""Worker seam for the non-finite-gradient test: the real trainer, with replica 0's loss made NaN
in the microbatches of the steps listed in RECOVER_HSDP_TEST_NAN_STEPS (comma-separated)."""
import os


def run_worker(cfg):
    import recover_hsdp.model as model
    from recover_hsdp.config import plain_config as _plain
    from recover_hsdp.workers.resilient import run_worker as real

    c = _plain(cfg)
    G = int(c["parallel"]["grad_accum"])
    S = int(c["parallel"]["shard_size"])
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    steps = {int(s) for s in os.environ.get("RECOVER_HSDP_TEST_NAN_STEPS", "").split(",") if s}
    orig = model.next_token_loss
    calls = [0]

    def poisoned(logits, y, **kw):
        loss = orig(logits, y, **kw)
        step = calls[0] // G  # no failures in this test: G microbatches per rank per step
        calls[0] += 1
        if rank // S == 0 and step in steps:
            loss = loss * float("nan")
        return loss

    model.next_token_loss = poisoned
    return real(cfg)
