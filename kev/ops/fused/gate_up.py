"""The MLP's gate/up projection with silu(gate) * up in its epilogue: one GEMM, one write.

cuBLAS's GEMM writes the [T, 2F] gate/up product, and `silu_mul` reads it back to write [T, F]:
at 32,768 tokens of Kev-4B that is 3.6 GB a layer moved for 1.2 GB of result, ~0.6 ms of an
H100's bandwidth on top of the GEMM's ~4.5 ms. Here each program computes one [BM, BN] tile of
gate and the matching tile of up (two accumulators over the same x tile), rounds both to the
activations' dtype as the GEMM's output would be, and stores silu(gate) * up with the roundings of
`activations.silu_mul`. So it equals F.linear then silu_mul up to the GEMM's own summation order
(cuBLAS's and this kernel's differ by bf16 ulps), and a replay is bit-identical to the last.

Loads and stores go through TMA tensor descriptors (Hopper's bulk copies; the interpreter runs
them too); the grid is persistent, one program per SM, walking the tiles in groups of GROUP_M
row blocks so a group's weight tiles are read from L2 while its x tiles stream.

Reference: F.linear(x, w) split into gate/up, then `kev.ops.fused.reference.silu_mul`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kev.ops.fused.activations import silu_times
from kev.ops.pdl import launch_options, wait_for_previous


on = False  # True: TritonOps.gate_up_silu runs this kernel (bench A/B: `--gate-up`); False: cuBLAS + silu_mul


@dataclass(frozen=True)
class GateUpConfig:
    BM: int = 128
    BN: int = 128  # of gate, and as many of up: a [BM, 2 BN] tile in all
    BK: int = 64
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False  # Triton's producer/consumer warps for the K loop (Hopper and later)
    flatten: bool = False  # the tile loop and the K loop pipelined as one (the next tile's loads under this one's store)


# The candidates bench.gate_up_ab times (and bench.kernel_resources compiles); the default is the first.
GATE_UP_CONFIGS = (
    GateUpConfig(),
    GateUpConfig(num_stages=4),
    GateUpConfig(warp_specialize=True),
    GateUpConfig(flatten=True),
    GateUpConfig(num_stages=4, flatten=True),
    GateUpConfig(BN=64, num_warps=4, num_stages=4),
    GateUpConfig(BN=64, num_warps=8, num_stages=5),
    GateUpConfig(BM=64, num_warps=4, num_stages=4),
    GateUpConfig(BM=256, BN=64, num_warps=8, num_stages=3),
)


@triton.jit(do_not_specialize=["T", "programs"])
def gate_up_silu_kernel(
    x_desc,  # [T, K]
    wg_desc, wu_desc,  # [F, K] each: the gate and up rows of the fused weight
    y_desc,  # [T, F] out
    T, F, K,
    programs,  # the grid's size (a runtime value: one compile whatever T gives)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr,
    FLATTEN: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    DT: tl.constexpr = y_desc.dtype
    n_m = tl.cdiv(T, BM)
    n_n = tl.cdiv(F, BN)
    per_group = GROUP_M * n_n
    for tile in tl.range(tl.program_id(0), n_m * n_n, programs, flatten=FLATTEN):
        # grouped order: GROUP_M row blocks share each column block while it is in L2
        first_m = (tile // per_group) * GROUP_M
        rows = min(n_m - first_m, GROUP_M)
        i_m = first_m + (tile % per_group) % rows
        i_n = (tile % per_group) // rows
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, K, BK, warp_specialize=WS):
            b_x = x_desc.load([i_m * BM, k])  # [BM, BK]
            acc_g = tl.dot(b_x, wg_desc.load([i_n * BN, k]).T, acc_g)
            acc_u = tl.dot(b_x, wu_desc.load([i_n * BN, k]).T, acc_u)
        # the GEMM's output rounding first, then silu_mul's own steps
        b_g = acc_g.to(DT).to(tl.float32)
        b_u = acc_u.to(DT).to(tl.float32)
        y_desc.store([i_m * BM, i_n * BN], silu_times(b_g, b_u, DT))


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA can address these: every row of x, the weight and the output starts 16-byte aligned."""
    e = x.element_size()
    return (x.ndim == 2 and x.stride(1) == 1 and (x.stride(0) * e) % 16 == 0 and x.data_ptr() % 16 == 0
            and weight.ndim == 2 and weight.is_contiguous() and (weight.shape[1] * e) % 16 == 0
            and weight.data_ptr() % 16 == 0 and (weight.shape[0] // 2 * e) % 16 == 0)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, config: GateUpConfig = GateUpConfig(),
                 programs: int | None = None) -> torch.Tensor:
    """silu(x @ w_gate^T) * (x @ w_up^T).

    x:      [T, K], unit stride over K
    weight: [2F, K] contiguous: the gate rows then the up rows (`FusedProjection.weight`)
    Every row of x, weight and the output 16-byte aligned (`supports`).
    programs: the persistent grid's size (default: the device's SM count)
    Returns [T, F] contiguous, x's dtype.
    """
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1] or weight.shape[0] % 2:
        raise ValueError(f"x [T, K] and weight [2F, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError("x and weight must share a dtype, weight contiguous, x unit-stride over K")
    if not supports(x, weight):
        raise ValueError(f"rows of x {tuple(x.shape)} (stride {x.stride(0)}) and weight {tuple(weight.shape)} "
                         "must start 16-byte aligned for TMA")
    T, K = x.shape
    F = weight.shape[0] // 2
    y = torch.empty((T, F), dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    c = config
    x_desc = TensorDescriptor(x, [T, K], [x.stride(0), 1], [c.BM, c.BK])
    wg_desc = TensorDescriptor(weight[:F], [F, K], [K, 1], [c.BN, c.BK])
    wu_desc = TensorDescriptor(weight[F:], [F, K], [K, 1], [c.BN, c.BK])
    y_desc = TensorDescriptor(y, [T, F], [F, 1], [c.BM, c.BN])
    tiles = triton.cdiv(T, c.BM) * triton.cdiv(F, c.BN)
    if programs is None:
        programs = sm_count(x.device)
    programs = min(programs, tiles)
    gate_up_silu_kernel[(programs,)](x_desc, wg_desc, wu_desc, y_desc, T, F, K, programs,
                                     BM=c.BM, BN=c.BN, BK=c.BK, GROUP_M=c.GROUP_M, WS=c.warp_specialize,
                                     FLATTEN=c.flatten, num_warps=c.num_warps, num_stages=c.num_stages,
                                     **launch_options())
    return y


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so the persistent loop runs more than once
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]
