"""FSDP2 (``parallel.fsdp=2``): ``fully_shard`` per unit and at the root over a 1-D mesh of the
replica's shard group, with every ReCoVer guarantee of the FSDP1 path (docs/fsdp2.md).

* FSDP2 never moves a byte across replicas: its mesh is the shard group only (1-D), so it has no
  replicate dimension and never all-reduces; the manager's deferred reduction does that.
* FSDP2 never divides and never pre-scales: on every FSDPModule
  ``set_force_sum_reduction_for_comms(True)`` and ``set_gradient_divide_factor(1.0)`` (a factor
  alone gives PREMUL_SUM, which gloo refuses); checked after wrapping (:func:`assert_sum_only`).
* The buckets are the toolkit's own: one flat fp32 tensor per FSDPModule (the parameters that
  unit manages, in its ``named_parameters`` order), and every parameter's ``.grad`` is a
  ``Shard(0)`` DTensor whose local tensor is a VIEW into it. FSDP2 accumulates a later
  microbatch's reduce-scattered shard with ``grad._local_tensor += new``, in place, so after the
  microbatch loop the bucket holds the plain SUM of this rank's shard over the contributing
  microbatches, exactly as FSDP1's ``flat_param.grad`` does, and the optimizer reads the
  divided result through the same views. No padding: shard j of a bucket is the concatenation
  of each parameter's rows of shard j (hsdp/layout.RowShardLayout).
* The gradient sync stays on for every microbatch (a reduce-scatter per microbatch, sharded
  fp32 accumulation, memory 1/S), as FSDP1's default.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


def _fsdp2():
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    return FSDPModule, MixedPrecisionPolicy, fully_shard


def fsdp_modules(model: nn.Module) -> list:
    """Every FSDPModule under (and including) ``model``, module pre-order (the bucket order)."""
    FSDPModule = _fsdp2()[0]
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _units(model: nn.Module, policy) -> list[nn.Module]:
    """The submodules to ``fully_shard`` before the root: an FSDP1 ``ModuleWrapPolicy`` (its
    classes), a set/tuple of classes, or a callable ``model -> modules``; None: root only."""
    if policy is None:
        return []
    classes = getattr(policy, "_module_classes", None)
    if classes is None and isinstance(policy, (set, frozenset, tuple, list)):
        classes = tuple(policy)
    if classes is not None:
        classes = tuple(classes)
        return [m for m in model.modules() if m is not model and isinstance(m, classes)]
    if callable(policy):
        out = list(policy(model))
        if not all(isinstance(m, nn.Module) for m in out):
            raise TypeError("an FSDP2 wrap callable must return the submodules to fully_shard")
        return out
    raise TypeError(f"auto_wrap_policy {policy!r}: at fsdp=2 give a ModuleWrapPolicy, module "
                    f"classes, or a callable model -> submodules")


def _mp_policy(mixed_precision):
    MixedPrecisionPolicy = _fsdp2()[1]
    if mixed_precision in (None, "fp32"):
        return MixedPrecisionPolicy()
    if mixed_precision == "bf16":   # bf16 compute and all-gather, fp32 reduce and grad shards
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        if mixed_precision.reduce_dtype not in (None, torch.float32) or (
                mixed_precision.reduce_dtype is None
                and mixed_precision.param_dtype not in (None, torch.float32)):
            raise ValueError(f"MixedPrecisionPolicy.reduce_dtype must be torch.float32 (got "
                             f"{mixed_precision.reduce_dtype}): the grad shards are the fp32 "
                             f"buckets the recovery layer snapshots and reduces")
        return mixed_precision
    raise ValueError(f"mixed_precision {mixed_precision!r}: at fsdp=2 give auto, bf16, fp32 or a "
                     f"torch.distributed.fsdp.MixedPrecisionPolicy")


def assert_sum_only(model: nn.Module) -> None:
    """Raise unless every FSDPModule reduces with a plain SUM and never divides."""
    for m in fsdp_modules(model):
        st = m._get_fsdp_state()
        pg = getattr(st, "_fsdp_param_group", None)
        if pg is None:
            continue
        if not getattr(pg, "force_sum_reduction_for_comms", False) or \
                getattr(pg, "gradient_divide_factor", None) != 1.0:
            raise RuntimeError(f"FSDP2 unit {type(m).__name__} would average or divide its "
                               f"gradients: wrap it with recover_hsdp (hsdp/substrate/fsdp2.py)")


def _check_user_sharded(model: nn.Module, shard_pg, topology):
    """A model the user ``fully_shard``-ed (a custom loop, over recover_hsdp.shard_mesh()): the
    root is an FSDPModule and every parameter a DTensor on a 1-D mesh over exactly this
    replica's shard group, Shard(0) (what the buckets and the verifier's layout assume)."""
    from torch.distributed.tensor import Shard

    FSDPModule = _fsdp2()[0]
    if not isinstance(model, FSDPModule):
        raise ValueError("fsdp=2: some submodules are fully_shard-ed but the root is not: call "
                         "fully_shard(model, mesh=mesh) last (or hand the manager the plain "
                         "model)")
    want = sorted(topology.replica_ranks(topology.replica))
    mesh = None
    for fqn, p in model.named_parameters():
        m = getattr(p, "device_mesh", None)
        if m is None:
            raise ValueError(f"fsdp=2: parameter {fqn} is not sharded by fully_shard")
        if m.ndim != 1 or sorted(m.mesh.flatten().tolist()) != want:
            raise ValueError(f"fsdp=2: parameter {fqn} is sharded over ranks "
                             f"{sorted(m.mesh.flatten().tolist())} ({m.ndim}-D mesh); the "
                             f"manager needs the replica's shard group {want} as a 1-D mesh: "
                             f"build it with recover_hsdp.shard_mesh()")
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"fsdp=2: parameter {fqn} is placed {tuple(p.placements)}; the "
                             f"buckets need Shard(0) (no shard_placement_fn)")
        mesh = mesh or m
    return mesh


@dataclass
class _Bucket:
    name: str                    # "i:<module fqn>"
    module_fqn: str
    flat: torch.Tensor           # the bucket: 1-D fp32, this rank's shards concatenated
    params: list = field(default_factory=list)   # (fqn, param, offset, local numel)
    grads: list = field(default_factory=list)    # the DTensor grads handed to the params


def _make_grad(p, view):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(view.view(p.to_local().shape), p.device_mesh, p.placements,
                              shape=p.shape, stride=p.stride(), run_check=False)


def _attach(model: nn.Module) -> list[_Bucket]:
    """One bucket per FSDPModule (pre-order), every managed parameter's grad a view into it."""
    names = {}
    for fqn, p in model.named_parameters():
        names.setdefault(id(p), fqn)
    units = fsdp_modules(model)
    mod_name = {id(m): n for n, m in model.named_modules()}
    owner: dict[int, int] = {}
    for u, m in enumerate(units):        # pre-order: a descendant's claim overwrites its parent's
        for p in m.parameters():
            owner[id(p)] = u
    buckets = []
    for u, m in enumerate(units):
        mine, seen = [], set()
        for p in m.parameters():
            if owner[id(p)] == u and id(p) not in seen:
                seen.add(id(p))
                mine.append(p)
        if not mine:
            continue
        dtype = {p.dtype for p in mine}
        if dtype != {torch.float32}:
            raise ValueError(f"fsdp=2: unit {mod_name[id(m)] or '<root>'!r} holds parameters of "
                             f"{sorted(map(str, dtype))}: the buckets are fp32 (keep fp32 master "
                             f"weights; bf16 compute goes through mixed_precision)")
        n = sum(p.to_local().numel() for p in mine)
        flat = torch.zeros(n, dtype=torch.float32, device=mine[0].to_local().device)
        b = _Bucket(f"{len(buckets)}:{mod_name[id(m)] or '<root>'}", mod_name[id(m)], flat)
        off = 0
        for p in mine:
            k = p.to_local().numel()
            g = _make_grad(p, flat[off:off + k])
            p.grad = g
            b.params.append((names[id(p)], p, off, k))
            b.grads.append(g)
            off += k
        buckets.append(b)
    return buckets


def _relink(b: _Bucket) -> None:
    """Put the bucket back under the params' grads if something replaced them (a user's
    ``zero_grad(set_to_none=True)``, a loaded state dict): their values are kept."""
    with torch.no_grad():
        for i, (_, p, off, k) in enumerate(b.params):
            g = p.grad
            if g is b.grads[i]:
                continue
            view = b.flat[off:off + k]
            view.copy_(g.to_local().reshape(-1) if g is not None else torch.zeros_like(view))
            b.grads[i] = p.grad = _make_grad(p, view)


class BucketAccumulator:
    """Runs one microbatch on an FSDP2 model (gradient sync on: one reduce-scatter per
    microbatch, sharded accumulation). ``contribute=False`` (the replica met its quota, or is a
    spare) still runs forward and backward (the shard group's collectives stay in lockstep) and
    leaves the buckets bit-exactly as they were (a copy before, restored after)."""

    def __init__(self, substrate, module):
        self.substrate, self.module = substrate, module
        self.computed = self.contributed = 0

    def reset(self) -> None:
        self.computed = self.contributed = 0

    def microbatch(self, loss_fn, *, contribute: bool = True, last: bool = False):
        buckets = None if contribute else self.substrate.buckets(self.module)
        saved = None if contribute else [t.detach().clone() for t in buckets]
        loss = loss_fn()
        loss.backward()
        if saved is not None:
            with torch.no_grad():
                for t, s in zip(buckets, saved):
                    t.copy_(s)
        self.computed += 1
        self.contributed += int(contribute)
        return loss.detach()


class Fsdp2Substrate:
    fsdp = 2
    name = "fsdp2"
    overlap_ok = False

    def wrap(self, model, shard_pg, *, auto_wrap_policy, device, topology, mixed_precision):
        from torch.distributed.device_mesh import DeviceMesh

        FSDPModule, _, fully_shard = _fsdp2()
        if shard_pg.size() != topology.shard_size or shard_pg.rank() != topology.shard_index:
            raise ValueError(f"shard group (size {shard_pg.size()}, rank {shard_pg.rank()}) does "
                             f"not match parallel.shard_size({topology.shard_size}) / shard "
                             f"index {topology.shard_index}")
        device = torch.device(device)
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            mesh = _check_user_sharded(model, shard_pg, topology)   # the user's own fully_shard
        else:
            mesh = DeviceMesh.from_group(shard_pg, device.type)
            mp = _mp_policy(mixed_precision)
            for m in _units(model, auto_wrap_policy):
                fully_shard(m, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        for m in fsdp_modules(model):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
        assert_sum_only(model)
        model._recover_buckets = _attach(model)   # type: ignore[attr-defined]
        model._recover_topology = topology        # type: ignore[attr-defined]
        model._recover_mesh = mesh                # type: ignore[attr-defined]
        return model

    @staticmethod
    def _buckets(module) -> list[_Bucket]:
        bs = getattr(module, "_recover_buckets", None)
        if bs is None:
            raise TypeError("not a module wrapped by the fsdp=2 substrate")
        return bs

    def describe(self, module) -> dict:
        """meta.json's record of what was built: the FSDPModules and (none) FSDP1 flat params."""
        from torch.distributed.fsdp._flat_param import FlatParameter

        return {"fsdp": 2, "fsdp2": {
            "fsdp_modules": len(fsdp_modules(module)),
            "flat_parameters": sum(isinstance(p, FlatParameter) for p in module.parameters()),
            "dtensor_parameters": sum(type(p).__name__ == "DTensor" or hasattr(p, "to_local")
                                      for p in module.parameters())}}

    def accumulator(self, module):
        return BucketAccumulator(self, module)

    def buckets(self, module):
        out = []
        for b in self._buckets(module):
            _relink(b)
            out.append(b.flat)
        return out

    def bucket_names(self, module):
        return [b.name for b in self._buckets(module)]

    def param_shards(self, module):
        """This rank's parameter shards per bucket (a fresh 1-D tensor each: FSDP2 keeps each
        parameter in its own storage)."""
        out = []
        with torch.no_grad():
            for b in self._buckets(module):
                parts = [p.to_local().detach().reshape(-1) for _, p, _, _ in b.params]
                out.append(torch.cat(parts))
        return out

    def load_param_shards(self, module, tensors) -> None:
        with torch.no_grad():
            for b, src in zip(self._buckets(module), tensors):
                src = src.reshape(-1)
                for _, p, off, k in b.params:
                    loc = p.to_local()
                    loc.copy_(src[off:off + k].view(loc.shape).to(loc.device))

    def layout(self, module):
        from recover_hsdp.hsdp.layout import ParamSlot, RowShardLayout

        S = module._recover_topology.shard_size
        return [RowShardLayout(index=i, module_fqn=b.module_fqn, shard_size=S, dtype="float32",
                               params=tuple(ParamSlot(fqn, tuple(p.shape), p.numel(), 0)
                                            for fqn, p, _, _ in b.params))
                for i, b in enumerate(self._buckets(module))]

    # --- DCP state dicts: torch's supported API, DTensors over the shard mesh --------------
    @staticmethod
    def _options():
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=False, cpu_offload=False)

    def _init_optim_state(self, mgr) -> None:
        """torch's ``_init_optim_state`` does nothing when grads exist, and ours always do (views
        into the buckets): so the empty state of a fresh optimizer (before a load) is made here
        the same way, one step at lr 0 over zero gradients, the buckets kept as they were."""
        opt = mgr.optimizer
        if opt.state:
            return
        buckets = self.buckets(mgr.module)
        saved = [b.clone() for b in buckets]
        lrs = [g.get("lr") for g in opt.param_groups]
        with torch.no_grad():
            for b in buckets:
                b.zero_()
            for g in opt.param_groups:
                if "lr" in g:
                    g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
            try:
                opt.step()
            finally:
                for g, lr in zip(opt.param_groups, lrs):
                    if lr is not None:
                        g["lr"] = lr
                for b, v in zip(buckets, saved):
                    b.copy_(v)

    def state_dicts(self, mgr) -> dict:
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)

        model = get_model_state_dict(mgr.module, options=self._options())
        self._init_optim_state(mgr)
        optim = get_optimizer_state_dict(mgr.module, mgr.optimizer, options=self._options())
        return {"model": model, "optim": optim}

    def load_state_dicts(self, mgr, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                             set_optimizer_state_dict)

        set_model_state_dict(mgr.module, state["model"], options=self._options())
        set_optimizer_state_dict(mgr.module, mgr.optimizer, state["optim"],
                                 options=self._options())
        self.buckets(mgr.module)   # the grads stay views into the buckets
