"""Registration of the torch.distributed backend "ulfm", cheaply.

`import recover_hsdp` calls `register_backend()`. It must not load the C++ extension, and it must
not import torch either (the policy layer and the planner import recover_hsdp without torch):
if torch.distributed is already imported the backend is registered at once, otherwise a one-shot
import hook registers it right after torch.distributed finishes loading (`import torch` loads it).
The extension itself loads on the first use of the backend.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings

BACKEND_NAME = "ulfm"

_lock = threading.RLock()
_registered = False
_hook: "_RegisterAfterImport | None" = None


def _create_backend(dist_backend_opts, backend_options):
    from recover_hsdp.collectives.group import create_backend

    return create_backend(dist_backend_opts, backend_options)


def register_now() -> None:
    """Register "ulfm" with torch.distributed (imports torch.distributed; idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        import torch.distributed as dist

        if not dist.is_available():
            return
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                          devices=["cpu", "cuda"])
        _registered = True
        _remove_hook()


def is_registered() -> bool:
    return _registered


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of `torch.distributed` so registration runs when its module is ready."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.distributed":
            return None
        spec = None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        real_exec_module = loader.exec_module

        def exec_module(module):
            real_exec_module(module)
            try:
                register_now()
            except Exception as e:  # never break `import torch`
                warnings.warn(f"recover_hsdp: could not register the ulfm backend: {e}",
                              RuntimeWarning, stacklevel=2)

        loader.exec_module = exec_module
        return spec


def _remove_hook() -> None:
    global _hook
    if _hook is not None:
        try:
            sys.meta_path.remove(_hook)
        except ValueError:
            pass
        _hook = None


def register_backend() -> None:
    """Make `dist.new_group(ranks, backend="ulfm")` available; cheap (no torch, no extension)."""
    global _hook
    with _lock:
        if _registered:
            return
        mod = sys.modules.get("torch.distributed")
        if mod is not None and hasattr(mod, "Backend"):
            register_now()
        elif _hook is None and mod is None:
            _hook = _RegisterAfterImport()
            sys.meta_path.insert(0, _hook)
