"""Programmatic dependent launch (PDL) for the project's own kernels, on Hopper and later.

A pass is ~650 kernels; in the small passes of an idle request (a six-short sweep: ~240 tokens,
5.4 ms of GPU time on the H200) most of them run a few microseconds, and the gap between one
kernel's end and the next one's start is a good part of that. Launched with PDL, a kernel may be
scheduled while the kernel before it drains; its first instruction, `griddepcontrol.wait`, holds
it until that kernel has finished and its writes are visible. Nothing is read or written before
the wait, and no kernel here signals its dependents early, so every kernel still sees everything
before it exactly as in plain stream order: same results, same bits. Only the launch latency is
hidden. It holds inside CUDA graphs (captured as programmatic edges). Kernels of others (cuBLAS,
fla) launch as before; one of ours after one of theirs still gains, as the wait covers it.

Every kernel takes the constexpr `USE_PDL` and starts with `wait_for_previous(USE_PDL)`; every
launch passes `**launch_options()`, which sets `USE_PDL` and Triton's `launch_pdl` together, so
the attribute is never set on a kernel that does not wait (tests/ops/test_pdl.py checks both
sides). Off under the interpreter and below sm_90. `off = True` launches in plain stream order:
the benchmarks' A/B switch (`python -m bench.single_request --no-pdl`), no service setting: it is
a launch mechanism that changes no result, not a tuning knob.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.runtime.driver import driver

off = False  # True: plain stream order (A/B runs)
_decided: dict[int, bool] = {}  # id(active driver) -> whether its device supports PDL


def enabled() -> bool:
    """Whether our launches use PDL here (checked per launch: cheap after the first)."""
    if off or triton.knobs.runtime.interpret:
        return False
    active = driver.active
    key = id(active)
    if key not in _decided:
        target = active.get_current_target()
        _decided[key] = target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90
    return _decided[key]


def launch_options() -> dict:
    """Keyword arguments for a launch of one of our kernels: `USE_PDL`, with `launch_pdl` when on."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled() else {"USE_PDL": False}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """A kernel's first statement: until the kernel launched before it is done (a no-op without PDL)."""
    if USE_PDL:
        gdc_wait()
