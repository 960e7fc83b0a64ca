"""Fresh imports of the project's Triton kernel modules (and fla) for CPU tests, put back afterwards.

Triton decides between compiled and interpreted kernels when `@triton.jit` runs (at import), so
`interpreted_kernels()` imports fresh copies of the kernel modules and of fla with
TRITON_INTERPRET=1, and `compiled_kernels()` fresh non-interpreted ones (for the compile-count
checks against a fake target). Both put the previous modules back afterwards: nothing leaks into
other tests. Under the interpreter every autotuned kernel runs one pinned config (the autotuner
cannot benchmark without a GPU).
"""

import importlib
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from bench.kernel_resources import HopperDriver as FakeHopper  # noqa: F401 - the tests' stand-in driver (sm_90)

MODULES = ("kev.ops.conv.indexed_conv", "kev.ops.delta_rule.indexed_scan",
           "kev.ops.delta_rule.chunk_steps", "kev.ops.delta_rule.prep",
           "kev.ops.attention.paged_prefix",
           "kev.ops.fused", "kev.ops.triton_ops", "kev.ops.gathered_ops")
NAMES = dict(conv="kev.ops.conv.indexed_conv", scan="kev.ops.delta_rule.indexed_scan",
             prep="kev.ops.delta_rule.prep",
             attn="kev.ops.attention.paged_prefix", norms="kev.ops.fused.norms",
             activations="kev.ops.fused.activations", triton_ops="kev.ops.triton_ops",
             gathered_ops="kev.ops.gathered_ops")


def swap_modules(names_prefixes, saved=None):
    """Remove (and return) the modules under the given prefixes; restore `saved` when given."""
    gone = {n: m for n, m in sys.modules.items() if n == "fla" or n.startswith(names_prefixes)}
    for n in gone:
        del sys.modules[n]
    if saved is not None:
        sys.modules.update(saved)
        for n, m in saved.items():  # parent packages point at the restored submodules again
            parent, _, child = n.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, m)
    return gone


def _import_all():
    return SimpleNamespace(**{short: importlib.import_module(name) for short, name in NAMES.items()})


@contextmanager
def interpreted_kernels():
    prefixes = ("fla.", *MODULES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        import triton.runtime.interpreter as interpreter
        from triton.runtime.autotuner import Autotuner

        # numpy >= 2.4 refuses int() of the interpreter's 1-element scalars, which `range(tensor)`
        # needs (loops bounded by loaded lengths). Patch the interpreter's __index__ for the run.
        original = interpreter._patch_lang_tensor

        def patch_lang_tensor(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        mp.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)

        # triton.language's own @jit helpers (tl.zeros, tl.cdiv, ...) were decorated when triton was
        # first imported, maybe before the variable was set: run them interpreted when called from
        # an interpreted kernel instead of refusing.
        from triton.runtime.jit import JITFunction

        as_interpreted = {}

        def call_interpreted(self, *args, **kwargs):
            if self.fn not in as_interpreted:
                as_interpreted[self.fn] = interpreter.InterpretedFunction(self.fn)
            return as_interpreted[self.fn](*args, **kwargs)

        mp.setattr(JITFunction, "__call__", call_interpreted)
        saved = swap_modules(prefixes)
        try:
            mods = _import_all()
            for name, mod in list(sys.modules.items()):  # pin fla's autotuned kernels to one config
                if name.startswith("fla"):
                    for obj in list(vars(mod).values()):
                        while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                            obj = obj.fn
                        if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                            mp.setattr(obj, "configs", obj.configs[:1])
            yield mods
        finally:
            swap_modules(prefixes, saved)


@contextmanager
def compiled_kernels():
    """Fresh non-interpreted imports of the kernel modules (whatever an interpreted import left active)."""
    prefixes = ("fla.", *MODULES)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        saved = swap_modules(prefixes)
        try:
            yield _import_all()
        finally:
            swap_modules(prefixes, saved)


def poison_empty(monkeypatch):
    """Every float tensor allocated with torch.empty / new_empty starts as NaN: an unwritten element fails."""
    import torch

    empty, new_empty = torch.empty, torch.Tensor.new_empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_new_empty(self, *args, **kwargs):
        t = new_empty(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch.Tensor, "new_empty", nan_new_empty)


def _storage_span(t):
    return t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()


def _tensor_span(t):
    """[first, last + 1) bytes of the elements of a tensor view (any strides >= 0)."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@contextmanager
def _checked_accesses(allowed):
    """Under the interpreter: `allowed(addresses, itemsize)` -> bool per address must hold for every
    load and store that a kernel's mask lets through, else AssertionError."""
    import triton.runtime.interpreter as interpreter

    real = interpreter._interpreter

    def check(kind, ptrs, mask, itemsize):
        addrs = ptrs[mask.astype(bool)]
        ok = allowed(addrs, itemsize)
        assert ok.all(), f"{kind} of {int((~ok).sum())} elements where no access may go"

    class Guarded:
        def __getattr__(self, name):
            return getattr(real, name)

        def load(self, ptrs, mask, other, dtype):
            check("load", ptrs, mask, np.dtype(dtype).itemsize)
            return real.load(ptrs, mask, other, dtype)

        def store(self, ptrs, value, mask):
            check("store", ptrs, mask, value.dtype.itemsize)
            return real.store(ptrs, value, mask)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_interpreter", Guarded())
        yield


def accesses_inside(*tensors):
    """Every load and store a kernel's mask lets through falls inside one of `tensors`' storages.
    On a GPU such an access faults only when it reaches unmapped memory (a masked-out row never
    does), so a kernel's bounds are checked here, on the CPU, whatever lies around its buffers."""

    spans = [_storage_span(t) for t in tensors]

    def allowed(addrs, itemsize):
        inside = np.zeros(addrs.shape, dtype=bool)
        for lo, hi in spans:
            inside |= (addrs >= lo) & (addrs + itemsize <= hi)
        return inside

    return _checked_accesses(allowed)


def accesses_avoid(*guards):
    """No load or store a kernel's mask lets through touches `guards` (tensor views: the rows
    allocated past an input, say): for kernels that also use buffers they allocate themselves."""

    spans = [_tensor_span(t) for t in guards]

    def allowed(addrs, itemsize):
        ok = np.ones(addrs.shape, dtype=bool)
        for lo, hi in spans:
            ok &= (addrs + itemsize <= lo) | (addrs >= hi)
        return ok

    return _checked_accesses(allowed)
