"""FSDP1 HYBRID_SHARD with the cross-replica reduction DEFERRED to after the microbatch loop.

Invariants this module keeps (the recovery layer relies on each one):

* FSDP never moves a byte across replicas. Every FSDP state's replicate group (``_inter_node_pg``)
  is a :class:`NoOpReplicateGroup`: FSDP's per-backward ``all_reduce`` on it is a counted no-op and
  any other collective on it raises. Intra-replica traffic (all-gather, reduce-scatter) runs on the
  real shard group only.
* FSDP never divides. Both ``_gradient_predivide_factor`` and ``_gradient_postdivide_factor`` are 1
  on every FSDP state, so after the microbatch loop each handle's ``flat_param.grad`` holds the plain
  SUM over this replica's contributing microbatches of this rank's gradient shard. The manager owns
  the divisor (``B = W_init * G_init``, never the live world size).
* The buckets are ``flat_param.grad`` of every FSDP handle, in module pre-order. That order, the
  shapes and the shard ranges are identical on every rank with the same shard index, so the
  cross-replica all-reduce of shard index j pairs the same buckets on every replica.
* Buckets are mutated IN PLACE only (``all_reduce``, ``copy_``, ``div_``): with
  ``use_orig_params=True`` the original parameters' ``.grad`` are views into them.
* After init nothing here needs the rendezvous store again (rank 0 may die; see
  :func:`init_distributed_from_env`).

Everything private that is touched is listed in docs/hsdp.md and checked at wrap time against the
torch version this was verified on (:data:`VERIFIED_TORCH`).

The code lives in four modules along its seams; this module is their public face (documented
in docs/hsdp.md): ``from recover_hsdp.hsdp import fsdp_hybrid as fh; fh.wrap_hybrid_shard(...)``
reaches the public names of all four, and nothing private:

* :mod:`recover_hsdp.hsdp.topology`: the W x S topology, shard groups, rendezvous and store;
* :mod:`recover_hsdp.hsdp.wrapping`: FSDP wrapping, the no-op replicate group, the torch check;
* :mod:`recover_hsdp.hsdp.buckets`: the buckets and the microbatch accumulator;
* :mod:`recover_hsdp.hsdp.layout`: the verifier's parameter layout and flat-shard rebuild.
"""
from __future__ import annotations

# flake8: noqa  (the public face of four modules)

from recover_hsdp.hsdp.topology import (DEFAULT_SHARD_TIMEOUT_S, DEFAULT_STORE_TIMEOUT_S,
                                        ENV_SHARD_TIMEOUT, ENV_STORE, check_identical_init,
                                        HybridTopology, init_distributed_from_env, local_device,
                                        new_shard_groups, serve_store, shard_group_failure_kind,
                                        shard_timeout_s, shard_group_timeout_s)
from recover_hsdp.hsdp.wrapping import (ENV_ALLOW_UNVERIFIED, VERIFIED_TORCH,
                                        assert_divide_stripped, bf16_mixed_precision,
                                        check_torch_version, DeferredReductionViolation,
                                        fsdp_states, NoOpReplicateGroup, UnsupportedTorchError,
                                        wrap_hybrid_shard)
from recover_hsdp.hsdp.buckets import (allreduce_grad_shards, flat_param_handles,
                                       grad_shard_names, grad_shards, MicrobatchAccumulator,
                                       to_device)
from recover_hsdp.hsdp.layout import (PARAM_PADDING_VALUE, flat_shard_from_full, FlatParamLayout,
                                      local_flat_shards, parameter_layout, ParamSlot)
