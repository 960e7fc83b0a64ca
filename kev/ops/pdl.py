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

Off by default: measured side by side on an H100 (5ea7209, `bench/results/single_request*.json`),
it bought nothing on the GPU (a six-short sweep's replay 6.35 ms off / 6.39 on, five-long's 36.87 /
36.76) and cost host time on eager launches (six-short's eager new request 47.9 / 50.9 ms); the
graphed cached requests were 4% slower with it (5.95 / 6.22 ms). Kept as the A/B (`on = True`).

Every kernel takes the constexpr `USE_PDL` and starts with `wait_for_previous(USE_PDL)`; every
launch passes `**launch_options()`, which sets `USE_PDL` and Triton's `launch_pdl` together, so
the attribute is never set on a kernel that does not wait (tests/ops/test_pdl.py checks both
sides). Never under the interpreter or below sm_90. `on = True` launches with it: the benchmarks'
A/B switch (`python -m bench.single_request --pdl`), no service setting: it is a launch mechanism
that changes no result, not a tuning knob.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.runtime.driver import driver

on = False  # True: launch with PDL where the device has it (A/B runs; off by default, see above)
_decided: dict[int, bool] = {}  # id(active driver) -> whether its device supports PDL


def enabled() -> bool:
    """Whether our launches use PDL here (checked per launch: cheap after the first)."""
    if not on or triton.knobs.runtime.interpret:
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
