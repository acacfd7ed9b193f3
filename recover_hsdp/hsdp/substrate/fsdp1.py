"""FSDP1 HYBRID_SHARD (``parallel.fsdp=1``, the default): the substrate the toolkit was built on.
Everything lives in wrapping.py / buckets.py / layout.py / state_dicts.py; this is their face
behind the substrate interface (hsdp/substrate/__init__.py)."""
from __future__ import annotations


class Fsdp1Substrate:
    fsdp = 1
    name = "fsdp1"
    overlap_ok = True

    def wrap(self, model, shard_pg, *, auto_wrap_policy, device, topology, mixed_precision):
        from recover_hsdp.hsdp import fsdp_hybrid as fh

        mp = (fh.bf16_mixed_precision() if mixed_precision == "bf16"
              else None if mixed_precision in (None, "fp32") else mixed_precision)
        return fh.wrap_hybrid_shard(model, shard_pg, auto_wrap_policy=auto_wrap_policy,
                                    device=device, topology=topology, mixed_precision=mp)

    def describe(self, module) -> dict:
        """What meta.json records of the substrate: nothing (the default since the start)."""
        return {}

    def accumulator(self, module):
        from recover_hsdp.hsdp.buckets import MicrobatchAccumulator

        return MicrobatchAccumulator(module)

    def buckets(self, module):
        from recover_hsdp.hsdp.buckets import grad_shards

        return grad_shards(module)

    def bucket_names(self, module):
        from recover_hsdp.hsdp.buckets import grad_shard_names

        return grad_shard_names(module)

    def param_shards(self, module):
        from recover_hsdp.hsdp import fsdp_hybrid as fh

        return fh.local_flat_shards(module)

    def load_param_shards(self, module, tensors) -> None:
        import torch

        with torch.no_grad():
            for dst, src in zip(self.param_shards(module), tensors):
                dst.copy_(src.to(dst.device))

    def layout(self, module):
        from recover_hsdp.hsdp.layout import parameter_layout

        return parameter_layout(module)

    def state_dicts(self, mgr) -> dict:
        from recover_hsdp.hsdp.state_dicts import state_dicts

        return state_dicts(mgr)

    def load_state_dicts(self, mgr, state: dict) -> None:
        from recover_hsdp.hsdp.state_dicts import load_state_dicts

        load_state_dicts(mgr, state)
