"""Next-token cross entropy normalised by a FIXED per-microbatch token count.

Why not `F.cross_entropy(..., reduction="mean")`: ReCoVer accumulates the gradients of a variable
set of microbatches (whatever the survivors contributed) and divides the sum once, by a divisor
the policy fixes (B for the static policy, the committed count for the adaptive one). For that
sum to be a mean over tokens, every microbatch must contribute

    loss_mb = sum over its tokens of CE(token) / N_mb,   N_mb = micro_batch_size * seq_len,

with N_mb the same constant for every microbatch. Then sum_b grad(loss_b) / B is exactly the
gradient of the mean token loss over the B microbatches, whichever replica computed which
microbatch and in whatever order (up to float summation order). A per-microbatch "mean over the
non-ignored tokens" would weight microbatches unequally as soon as they hold different numbers of
ignored targets. With packed sequences every target is a real token, so the normaliser equals
the token count and loss_mb is also that microbatch's mean loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor,
                    tokens_per_microbatch: int | None = None) -> torch.Tensor:
    """Sum of next-token cross entropy over all target positions / `tokens_per_microbatch`.

    logits: (B, T, V) any float dtype (upcast to fp32 here); targets: (B, T) int64, already
    shifted (targets[:, t] is the token after input_ids[:, t]); IGNORE_INDEX positions contribute
    0 but still count in the default normaliser. tokens_per_microbatch: defaults to
    targets.numel() (= micro_batch_size * seq_len); pass the configured constant explicitly in
    training code so that a short or partly-ignored microbatch cannot change the weighting.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets "
                         f"{tuple(targets.shape)}")
    n = targets.numel() if tokens_per_microbatch is None else int(tokens_per_microbatch)
    if n <= 0:
        raise ValueError(f"tokens_per_microbatch({n}) must be > 0")
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return total / n
