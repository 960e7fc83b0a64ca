"""Autotune by shape class: one autotune cache per shape class for every hot Triton kernel.

Triton's `Autotuner` keeps one `.cache` dict per kernel, keyed by the kernel's `key` arguments.
fla's keys omit the sequence count and length, so whatever call comes first (often a tiny
warm-up) decides the config of every later pass; measured on the H200, that costs wide passes
1.1-1.9x (DESIGN.md §3). Here a pass is put into a `ShapeClass` from host ints known when it is
built (sequence count and token count: rows vs documents, few vs many), and `ClassTuner.use(cls)`
swaps every hot autotuner's `.cache` for that class's own dict around the pass. The project's own
kernels also carry log2 (count, length) buckets in their keys (`N_CLASS`, `T_CLASS`); inside a
class those entries are dropped from the key, so the class alone decides and a pass of an
unwarmed bucket never autotunes (an autotune inside CUDA-graph capture breaks the capture).

Per worker process: the autotuners are module globals, so every process (scorer worker, bank
service) tunes its own. Triton's on-disk autotune cache is turned off for these kernels (fla
enables it by default through FLA_CACHE_RESULTS): a config tuned by another process, on another
shape, would be reused silently. `warm_up` runs one representative pass per class with the real
model, dtypes and pools before any CUDA-graph capture.

    tuner = ClassTuner(hot_autotuners())
    runner = Runner(model, bank, TritonOps(), tuner=tuner)
    warm_up(runner, ShapeClass)              # start-up: autotune every class
    with tuner.use(classify(n_seqs, n_tokens)):
        model(...)                           # what Runner does around each pass
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from triton.runtime.autotuner import Autotuner

from kev.ops.meta import PassMeta

if TYPE_CHECKING:
    from kev.runner import Runner

ROW_TOKENS = 128  # mean tokens per sequence up to which a pass is row-like
CLASS_KEY_ARGS = frozenset({"N_CLASS", "T_CLASS"})  # the own kernels' finer buckets, dropped inside a class


class ShapeClass(enum.Enum):
    """Which autotune cache a pass uses. Mean sequence length splits rows from documents."""

    ROWS_FEW = "rows_few"  # <= 8 sequences of <= 128 tokens: one request's rows, a short new document
    ROWS_MID = "rows_mid"  # 9-32 such sequences
    ROWS_WIDE = "rows_wide"  # > 32: wide row batches (96 x 32-64)
    DOCS_FEW = "docs_few"  # <= 4 sequences of > 128 tokens: long single documents (chunks of 8k)
    DOCS_WIDE = "docs_wide"  # > 4: batched new documents (16 x 2,048)

    @property
    def rows(self) -> bool:
        return self in (ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID, ShapeClass.ROWS_WIDE)


# One representative pass per class for `warm_up`: (sequences, tokens each). ROWS_MID tunes on
# 16 x 64: every kernel's best config there is within 5% of best at 32 x 64 too (the H200 map);
# 24 x 48 picked fla's WY recompute with num_stages 4, 1.24x best at 16 x 64 and 1.10x at 32 x 64.
REPRESENTATIVE: dict[ShapeClass, tuple[int, int]] = {
    ShapeClass.ROWS_FEW: (6, 32),
    ShapeClass.ROWS_MID: (16, 64),
    ShapeClass.ROWS_WIDE: (96, 64),
    ShapeClass.DOCS_FEW: (1, 4096),
    ShapeClass.DOCS_WIDE: (16, 2048),
}


def classify(num_seqs: int, num_tokens: int) -> ShapeClass:
    """The class of a pass of `num_seqs` sequences and `num_tokens` tokens in all (host ints:
    tensor shapes or the lengths a batch was built from, never a device read)."""
    if num_seqs <= 0:
        raise ValueError(f"a pass needs at least one sequence, got num_seqs={num_seqs}")
    if num_tokens <= ROW_TOKENS * num_seqs:
        if num_seqs <= 8:
            return ShapeClass.ROWS_FEW
        return ShapeClass.ROWS_MID if num_seqs <= 32 else ShapeClass.ROWS_WIDE
    return ShapeClass.DOCS_FEW if num_seqs <= 4 else ShapeClass.DOCS_WIDE


def classify_lens(lens: Iterable[int]) -> ShapeClass:
    lens = list(lens)
    return classify(len(lens), sum(lens))


def classify_cu_seqlens(cu_seqlens: torch.Tensor | list[int]) -> ShapeClass:
    """From a host `cu_seqlens` ([N + 1]); a device tensor would need a sync: use the shapes instead."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError("cu_seqlens must be on the host; classify device batches by their shapes")
        cu_seqlens = cu_seqlens.tolist()
    return classify(len(cu_seqlens) - 1, cu_seqlens[-1] - cu_seqlens[0])


def unwrap_autotuner(kernel) -> Autotuner:
    """The `Autotuner` inside a kernel object (`triton.heuristics` wraps fla's)."""
    obj = kernel
    while not isinstance(obj, Autotuner):
        if not hasattr(obj, "fn"):
            raise TypeError(f"{kernel!r} is not an autotuned Triton kernel")
        obj = obj.fn
    return obj


def hot_autotuners() -> dict[str, Autotuner]:
    """Every autotuned kernel a `TritonOps` pass launches: the project's own and fla's."""
    from fla.ops.common.chunk_o import chunk_fwd_kernel_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd_kernel
    from fla.ops.utils.cumsum import chunk_local_cumsum_scalar_kernel

    from kev.ops.attention import paged_prefix
    from kev.ops.conv import indexed_conv
    from kev.ops.delta_rule import indexed_scan

    kernels = {
        "indexed_conv": indexed_conv._tuned_conv_kernel,
        "l2norm_heads": indexed_scan._tuned_l2norm,
        "chunk_local_cumsum": chunk_local_cumsum_scalar_kernel,
        "kkt_solve": chunk_gated_delta_rule_fwd_kkt_solve_kernel,
        "recompute_w_u": recompute_w_u_fwd_kernel,
        "indexed_scan": indexed_scan._tuned_scan_kernel,
        "chunk_fwd_o": chunk_fwd_kernel_o,
        "paged_prefix_attention": paged_prefix._tuned_attn_kernel,
    }
    return {name: unwrap_autotuner(k) for name, k in kernels.items()}


class ClassCache(dict):
    """One class's autotune cache for one kernel. Keys lose their `CLASS_KEY_ARGS` entries, so the
    class, not the kernel's own (count, length) bucket, decides the config. Triton and fla only
    use `in`, `[]`, `[]=` and `pop` on an autotuner's cache."""

    def __init__(self, drop: tuple[int, ...] = ()):
        super().__init__()
        self.drop = frozenset(drop)

    def _key(self, key):
        return tuple(v for i, v in enumerate(key) if i not in self.drop) if self.drop else key

    def __contains__(self, key):
        return super().__contains__(self._key(key))

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __setitem__(self, key, value):
        super().__setitem__(self._key(key), value)

    def get(self, key, default=None):
        return super().get(self._key(key), default)

    def pop(self, key, *default):
        return super().pop(self._key(key), *default)


# One lock for every tuner: the autotuners are process globals, so two passes that swap caches
# must not interleave (passes of one process run one at a time on its stream anyway).
_SWAP_LOCK = threading.RLock()


class ClassTuner:
    """Per-class autotune caches for `autotuners` (name -> Autotuner), disk cache off."""

    def __init__(self, autotuners: Mapping[str, Autotuner]):
        from fla.ops.utils.cache import FLA_CACHE_MODE, FlaCacheMode

        if FLA_CACHE_MODE is not FlaCacheMode.DISABLED:
            raise ValueError(f"FLA_CACHE_MODE={FLA_CACHE_MODE.value}: fla would load configs tuned elsewhere "
                             f"into the class caches; unset it")
        self.autotuners = dict(autotuners)
        self._caches: dict[ShapeClass, dict[str, ClassCache]] = {}
        self._active: ShapeClass | None = None
        for at in self.autotuners.values():
            at.cache_results = False  # Triton's on-disk autotune cache, off for these kernels

    def caches(self, cls: ShapeClass) -> dict[str, ClassCache]:
        """Name -> that class's cache (created empty on first use)."""
        if cls not in self._caches:
            self._caches[cls] = {name: ClassCache(tuple(i for i, k in enumerate(at.keys) if k in CLASS_KEY_ARGS))
                                 for name, at in self.autotuners.items()}
        return self._caches[cls]

    def tuned(self, cls: ShapeClass) -> bool:
        """Whether every kernel has a config in `cls`'s cache."""
        return cls in self._caches and all(len(c) for c in self._caches[cls].values())

    @contextmanager
    def use(self, cls: ShapeClass) -> Iterator[None]:
        """Every autotuner reads and fills `cls`'s cache inside; the previous caches come back after."""
        with _SWAP_LOCK:
            caches = self.caches(cls)
            saved = {name: at.cache for name, at in self.autotuners.items()}
            previous, self._active = self._active, cls
            try:
                for name, at in self.autotuners.items():
                    at.cache = caches[name]
                yield
            finally:
                for name, at in self.autotuners.items():
                    at.cache = saved[name]
                self._active = previous

    @property
    def active(self) -> ShapeClass | None:
        return self._active

    def chosen(self, cls: ShapeClass) -> dict[str, list[str]]:
        """Name -> the configs `cls`'s cache holds (for logs and the config map)."""
        return {name: [str(c) for c in cache.values()] for name, cache in self.caches(cls).items()}


@torch.no_grad()
def warm_up(runner: "Runner", classes: Iterable[ShapeClass] = tuple(ShapeClass), *, row_slot: int = -1,
            row_prefix: int = 0, seed: int = 0) -> list[ShapeClass]:
    """Autotune (and compile) every hot kernel for each class: one pass of the class's
    representative shape through the real model, pools and dtypes. Nothing is written to the
    bank (write slots -1). Row classes read `row_slot` with `row_prefix` stored tokens when given
    (a document already in the bank, so attention sees a real prefix), else start from nothing.
    Call before any CUDA-graph capture. Returns the classes warmed."""
    if runner.tuner is None:
        raise ValueError("the runner has no ClassTuner")
    device, bank, cfg = runner.device, runner.bank, runner.model.cfg
    gen = torch.Generator().manual_seed(seed)
    done = []
    for cls in classes:
        n, L = REPRESENTATIVE[cls]
        read, prefix = (row_slot, row_prefix) if cls.rows and row_slot >= 0 else (-1, 0)
        as_long = dict(dtype=torch.int64, device=device)
        slots = torch.full((n,), read, **as_long)
        meta = PassMeta(cu_seqlens=torch.arange(n + 1, **as_long) * L, read_slots=slots,
                        write_slots=torch.full((n,), -1, **as_long), prefix_lens=torch.full((n,), prefix, **as_long),
                        block_table=bank.block_table[slots.clamp(min=0)],
                        positions=(torch.arange(L, **as_long) + prefix).repeat(n))
        tokens = torch.randint(0, cfg.vocab_size, (n * L,), generator=gen).to(device)
        picks = torch.arange(n, **as_long) * L + (L - 1)
        with runner.tuner.use(cls):
            runner.model(tokens, meta, bank.pools, runner.ops, picks=picks)
        done.append(cls)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return done
