"""What a custom loop's run record says about its user code, so that ``recover-hsdp verify`` can
rebuild it (docs/custom_loop.md, "The run record and verify").

A custom loop's model, optimizer, loss and data are the user's code, not config keys. The loop
builds them through ONE importable factory, a function ``module:function`` that takes JSON
keyword arguments and returns :class:`CustomParts`; the loop gives those parts to the manager,
and the run record names the factory and its arguments (meta.json ``custom``). The verifier
imports the same factory, calls it with the same arguments and replays the run on what it gets::

    parts = CustomParts.build(make_parts, data_slices=2)   # make_parts(**kw) -> CustomParts
    mgr = HSDPULFMTrainingManager(parts.model(), optimizer_factory=parts.optimizer_factory,
                                  microbatch_fn=parts.microbatch_fn, loss_fn=parts.loss_fn,
                                  lr_fn=parts.lr_fn, grad_clip=parts.grad_clip, ...)
    rec = record_run(mgr, run_dir, parts)                   # recover_hsdp.workers.custom

Plain Python here (no torch, no hsdp): the layer of the run record.
"""
from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from recover_hsdp.record.io import RecordError


@dataclass
class CustomParts:
    """The user code of a custom loop, as one factory returns it.

    model(): a FRESH model, initialised exactly as the run's (same seed; the verifier compares
    the run's initial parameters with it bit for bit). optimizer_factory(module) -> Optimizer.
    loss_fn(module, inputs, targets): the MEAN loss over the given rows. microbatch(id) ->
    (inputs, targets) of a replica's WHOLE microbatch (S * micro_batch_size rows): a function
    of the id ALONE, whichever replica computes it (ids are data addresses: docs/custom_loop.md).
    lr_fn(step) -> lr, optional. grad_clip: the manager's grad_clip (None: off).
    fingerprint: what microbatch(id) depends on besides the id (corpus, tokenizer, shapes);
    recorded, and the verifier refuses data whose fingerprint differs. name: for messages.
    """

    model: Callable[[], Any]
    optimizer_factory: Callable[[Any], Any]
    loss_fn: Callable[[Any, Any, Any], Any]
    microbatch: Callable[[int], tuple]
    lr_fn: Optional[Callable[[int], float]] = None
    grad_clip: Optional[float] = None
    fingerprint: Optional[str] = None
    name: str = "custom"
    #: how these parts were made (set by build(): the factory reference and its arguments)
    ref: Optional[dict] = field(default=None, repr=False)

    def microbatch_fn(self, replica: int, mb_id: int) -> tuple:
        """The manager's ``microbatch_fn(replica, id)``: the data of ``id``; ``replica`` (the
        replica that computes it) is deliberately ignored."""
        return self.microbatch(int(mb_id))

    @classmethod
    def build(cls, factory: Callable[..., "CustomParts"] | str, **kwargs: Any) -> "CustomParts":
        """``factory(**kwargs)``, remembering how (what the run record names). ``factory``: a
        module-level function, or its ``"module:function"``; ``kwargs`` must be JSON."""
        ref = factory_ref(factory, kwargs)
        fn = factory if callable(factory) else import_factory(ref)
        parts = fn(**kwargs)
        if not isinstance(parts, cls):
            raise TypeError(f"{ref['factory']} returned {type(parts).__name__}, not CustomParts")
        parts.ref = ref
        return parts


def factory_ref(factory: Callable[..., Any] | str, kwargs: Mapping[str, Any]) -> dict:
    """{"factory": "module:function", "path": dir or None, "kwargs": {...}} for the record.

    A function of a script run as ``python path/loop.py`` lives in ``__main__``: it is named
    by the script's file stem, and ``path`` is the script's directory (where the verifier looks
    for it when the module is not importable otherwise)."""
    try:
        json.dumps(dict(kwargs), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise RecordError(f"factory arguments must be JSON values: {e}") from None
    path = None
    if isinstance(factory, str):
        name = factory
    else:
        mod, qual = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
        if not mod or "<" in qual or "." in qual:
            raise RecordError(f"factory {factory!r} must be a module-level function")
        m = sys.modules.get(mod)
        src = getattr(m, "__file__", None)
        if mod == "__main__":
            if not src:
                raise RecordError("a factory defined in an interactive __main__ cannot be "
                                  "imported by the verifier: put it in a module")
            mod = Path(src).stem
        if src:
            path = str(Path(src).resolve().parent)
        name = f"{mod}:{qual}"
    if name.count(":") != 1 or not all(name.split(":")):
        raise RecordError(f"factory {name!r}: expected 'module:function'")
    return {"factory": name, "path": path, "kwargs": dict(kwargs)}


def import_factory(ref: Mapping[str, Any]) -> Callable[..., Any]:
    """The function a record's ``custom`` entry names; RecordError (one line) if it cannot be
    imported. Tries the module as importable first, then from the recorded ``path``."""
    name = str(ref.get("factory") or "")
    if name.count(":") != 1:
        raise RecordError(f"custom.factory {name!r}: expected 'module:function'")
    mod_name, fn_name = name.split(":")
    path = ref.get("path")
    try:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if not path or e.name != mod_name.split(".")[0]:
                raise
            sys.path.insert(0, str(path))
            try:
                mod = importlib.import_module(mod_name)
            finally:
                if sys.path and sys.path[0] == str(path):
                    sys.path.pop(0)
    except Exception as e:  # noqa: BLE001 - any import problem is one line
        where = f" (also looked in {path})" if path else ""
        raise RecordError(f"custom.factory {name!r}: cannot import {mod_name!r}{where}: "
                          f"{type(e).__name__}: {' '.join(str(e).split())}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise RecordError(f"custom.factory {name!r}: {mod_name} has no function {fn_name!r}")
    return fn


def build_parts(ref: Mapping[str, Any]) -> CustomParts:
    """The verifier's side: import the recorded factory and call it with the recorded
    arguments. RecordError (one line) for anything that goes wrong."""
    fn = import_factory(ref)
    kwargs = ref.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise RecordError(f"custom.kwargs must be a mapping (got {type(kwargs).__name__})")
    try:
        parts = fn(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise RecordError(f"custom.factory {ref.get('factory')}(**{dict(kwargs)}) raised "
                          f"{type(e).__name__}: {' '.join(str(e).split())}") from None
    if not isinstance(parts, CustomParts):
        raise RecordError(f"custom.factory {ref.get('factory')} returned "
                          f"{type(parts).__name__}, not CustomParts")
    parts.ref = dict(ref)
    return parts


def data_slices(run_dir, default: int) -> int:
    """The number of data slices of the run in ``run_dir`` (its FIRST launch's width, meta.json
    ``w_init``): ids are k * W0 + slice for the life of a run, a resume at another width
    included. ``default`` (this launch's replicas) when the directory holds no record yet."""
    p = Path(run_dir) / "meta.json"
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return int(default)
    except (OSError, ValueError) as e:
        raise RecordError(f"{p}: cannot read: {e}") from None
    w = meta.get("w_init")
    if not isinstance(w, int) or w < 1:
        raise RecordError(f"{p}: w_init={w!r} is not a positive integer")
    return w
