"""Peers: the same training job under other fault-tolerance systems, for side-by-side benches.

`experiments.peers_worker` (in the checkout) is one replica-group process under torchft (Manager +
torchft DistributedDataParallel + torchft Optimizer wrapper + ProcessGroupGloo), or one rank of a
plain gloo DDP job (no torchft), training exactly what `recover-hsdp train` trains (llama_debug,
the embedded corpus, the static policy's DataAssignment ids, our AdamW + schedule). The supervisor
and the measurements are in `experiments.peers`.

`probe` holds the pure parts (no torch): decoding the probe gradients into the divisor torchft
actually applied and the replicas that contributed.
"""
from recover_hsdp.peers.probe import ProbeDecodeError, decode_probe, probe_weight

__all__ = ["ProbeDecodeError", "decode_probe", "probe_weight"]
