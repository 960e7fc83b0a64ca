"""Start-up warm-up: every hot kernel compiled and class-tuned through the real model, pools and
dtypes, before any CUDA-graph capture (`kev.exec.passes` calls it once per process; the benches too).

Each class runs its `CLASS_SHAPES` (kev.ops.autotune) through `ClassTuner.tune`, which keeps per
kernel the config with the least total time over those shapes. Nothing is written to the bank.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from kev.ops.shapes import CLASS_SHAPES, ClassShape, ShapeClass
from kev.ops.meta import PassMeta

if TYPE_CHECKING:
    from kev.exec.passes import Passes

log = logging.getLogger(__name__)


def tuned_picks(tuner, cls: ShapeClass) -> dict[str, list[str]]:
    """The configs `cls`'s cache holds per kernel (what `ClassTuner.tune` picked), as text for the log."""
    return {name: sorted({str(cfg) for cfg in cache.values()}) for name, cache in tuner.caches(cls).items() if cache}


def warm_shapes(cls: ShapeClass, *, row_slot: int = -1, row_prefix: int = 0,
                max_prefix: int | None = None) -> list[ClassShape]:
    """`cls`'s `CLASS_SHAPES` as `warm_up` can run them: a prefix reads `row_slot`'s document,
    `row_prefix` stored tokens, so it is cut to that; without a slot it is kept and read from
    synthetic pages (`_warm_pass`). Ops that hold at most `max_prefix` tokens of a row's prefix
    (the gathered variant's page buffer) warm with the prefix cut to that, the longest they serve.
    Duplicates dropped."""
    limits = [n for n in (row_prefix if row_slot >= 0 else None, max_prefix) if n is not None]
    return list(dict.fromkeys(ClassShape(s.seqs, s.tokens, min([s.prefix, *limits])) for s in CLASS_SHAPES[cls]))


def _warm_pass(runner: "Passes", shape: ClassShape, row_slot: int, gen: torch.Generator) -> None:
    """One pass of `shape` through the real model and pools; writes nothing (write slots -1).
    A prefix reads `row_slot`'s document when given. Without one (a scorer may not write the
    bank, so it has no document of its own at start-up) the rows start from empty recurrent and
    conv states, and attention reads `prefix` tokens of whatever the bank's pages hold through a
    synthetic block table (distinct pages per row, as real documents have): the same kernels,
    shapes and memory traffic as rows over a stored document, so the tuned configs fit them.
    Attention configs do depend on the prefix length (a no-prefix pick was 3.4x the best over a
    2,200-token prefix)."""
    device, bank, cfg = runner.device, runner.bank, runner.model.cfg
    n, L, prefix = shape.seqs, shape.tokens, shape.prefix
    as_long = dict(dtype=torch.int64, device=device)
    if prefix > 0 and row_slot >= 0:
        slots = torch.full((n,), row_slot, **as_long)
        table = bank.block_table[slots]
    else:
        slots = torch.full((n,), -1, **as_long)
        width = bank.block_table.shape[1]
        prefix = min(prefix, width * bank.pools.block_size)
        pages = max(bank.pools.num_blocks, 1)
        table = ((torch.arange(n, **as_long)[:, None] * width + torch.arange(width, **as_long)) % pages).to(torch.int32)
    meta = PassMeta(cu_seqlens=torch.arange(n + 1, **as_long) * L, read_slots=slots,
                    write_slots=torch.full((n,), -1, **as_long), prefix_lens=torch.full((n,), prefix, **as_long),
                    block_table=table, positions=(torch.arange(L, **as_long) + prefix).repeat(n))
    tokens = torch.randint(0, cfg.vocab_size, (n * L,), generator=gen).to(device)
    picks = torch.arange(n, **as_long) * L + (L - 1)
    runner.model(tokens, meta, bank.pools, runner.ops, picks=picks)


@torch.no_grad()
def warm_up(runner: "Passes", classes: Iterable[ShapeClass] = tuple(ShapeClass), *, row_slot: int = -1,
            row_prefix: int = 0, seed: int = 0) -> list[ShapeClass]:
    """Autotune (and compile) every hot kernel for each class over its shapes (`warm_shapes`:
    `CLASS_SHAPES`, prefixes read from `row_slot` when given, a document already in the bank with
    `row_prefix` stored tokens, so attention sees a real prefix), through the real model, pools
    and dtypes: `ClassTuner.tune` pins, per kernel and key, the config with the least total time
    over the shapes. Nothing is written to the bank. Call before any CUDA-graph capture. Returns
    the classes warmed."""
    if runner.tuner is None:
        raise ValueError("the runner has no ClassTuner")
    gen = torch.Generator().manual_seed(seed)
    done, classes = [], list(classes)
    log.info("start-up: warm-up classes 0/%d %s", len(classes), [c.value for c in classes])
    for k, cls in enumerate(classes, 1):
        start = time.perf_counter()
        shapes = warm_shapes(cls, row_slot=row_slot, row_prefix=row_prefix,
                             max_prefix=getattr(runner.ops, "max_prefix_tokens", None))
        runner.tuner.tune(cls, [functools.partial(_warm_pass, runner, s, row_slot, gen) for s in shapes])
        done.append(cls)
        log.info("start-up: warm-up classes %d/%d (%s: %d shapes in %.1f s)", k, len(classes), cls.value,
                 len(shapes), time.perf_counter() - start)
        log.info("autotune picks for class %s: %s", cls.value, tuned_picks(runner.tuner, cls))
    if torch.device(runner.device).type == "cuda":
        torch.cuda.synchronize(runner.device)
    return done
