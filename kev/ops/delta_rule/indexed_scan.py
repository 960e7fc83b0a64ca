"""The chunked gated delta rule whose state pass starts from bank slots by index: the indexed scan.

The project's own state-pass ("h") kernel walks the chunks of each sequence keeping the [K, BV]
fp32 state in registers. It starts from `state_pool[read_slots[n]]` through an explicit slot stride
(zeros for a negative index), stores the state at the start of every chunk for the output kernel,
and writes the final state only to `out_pool[write_slots[n]]` when that index is >= 0. No gather,
no copy, no `.contiguous()` anywhere near the bank. fla 0.6.0's
`chunk_gated_delta_rule_fwd_kernel_h_blockdim64` is the reference design.

`indexed_chunk_gated_delta_rule` is the whole forward: one launch that L2-normalises q and k and
forms the gates with their chunk-local cumsum (`prep`), then fla's fused KK^T + triangular solve +
WY recompute (`chunk_gated_delta_rule_fwd_intra`), our state pass, and fla's `chunk_fwd_o`. fla's
pieces are called with keywords on activations only (never the bank). fla 0.6.0 supports grouped
value heads natively (value head j reads key head j // (HV / H)), so q and k are never expanded. q
and k may be column views (the model's conv output): `prep` reads them in place and writes the
contiguous normalised copies fla's kernels need. fla's WY recompute reads v as contiguous
[T, HV, V] (the model's conv writes it so; other callers' v is copied). Gates follow fla 0.6.0: the
chunk cumsum is scaled by 1/ln 2 and every decay is an exp2.

Reference: `naive.recurrent_gated_delta_rule` / `chunk_torch.chunk_gated_delta_rule`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from fla.ops.common.chunk_o import chunk_fwd_o
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

from kev.ops.delta_rule.chunk_steps import chunk_outputs, next_state, slot_state, write_slot_state
from kev.ops.delta_rule.prep import CHUNK, delta_rule_inputs
from kev.ops.gates import DeltaGates
from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.utils import preserve_written_slots, shape_class

# (first sequence, end sequence) -> (pool, read slots [n1 - n0]) the sequences' state passes start from
StartStates = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


# The [K, BV] fp32 state lives in registers. Compiled for sm_90 at Kev-4B's heads
# (bench/kernel_resources.py), the 2-warp configs spill 32-616 bytes a thread and the 4-warp ones
# none (134-250 registers); the 8-warp (141-202 registers) and the 4-warp BV 16 ones (100-143: four
# times the programs, for passes of one or a few documents, whose state pass has little else to run
# in parallel) were added as candidates. The autotuner picks per shape class; every config gives
# the same bits.
SCAN_CONFIGS = [
    triton.Config({"BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BV in [32, 64]
    for num_warps in [2, 4]
    for num_stages in [2, 3]
] + [triton.Config({"BV": BV}, num_warps=num_warps, num_stages=num_stages)
     for BV, num_warps in [(32, 8), (64, 8), (16, 4)] for num_stages in [1, 2]]
if triton.knobs.runtime.interpret:  # the autotuner cannot benchmark without a GPU: pin one config
    SCAN_CONFIGS = SCAN_CONFIGS[:1]


@triton.jit(do_not_specialize=["N_CLASS", "T_CLASS"])
def indexed_scan_fwd_kernel(
    k,  # [T, H, K]
    w,  # [T, HV, K]
    u,  # [T, HV, V]
    g,  # [T, HV] fp32 chunk-local cumsum of the log2 decay
    h,  # [NTT, HV, K, V] out: state at the start of every chunk (k's dtype)
    v_new,  # [T, HV, V] out: u - w S
    state_pool,  # [S, HV, K, V] fp32, read through read_slots
    out_pool,  # [S', HV, K, V] fp32, written through write_slots
    read_slots, write_slots,  # [N]
    cu_seqlens,  # [N + 1]
    chunk_offsets,  # [N + 1] first chunk of each sequence in h
    stride_k_t, stride_w_t, stride_u_t, stride_g_t,
    stride_s_s, stride_s_h, stride_s_k, stride_s_v,
    stride_o_s, stride_o_h, stride_o_k, stride_o_v,
    N_CLASS, T_CLASS,  # shape-class autotune keys only
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    NT = tl.cdiv(L, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

    b_h = slot_state(state_pool, read_slots, i_n, i_h, o_k, o_v, m_kv,
                     stride_s_s, stride_s_h, stride_s_k, stride_s_v)  # [BK, BV]

    p_k = k + bos * stride_k_t + (i_h // (HV // H)) * K  # value head i_h reads key head i_h // (HV / H)
    p_w = w + bos * stride_w_t + i_h * K
    p_u = u + bos * stride_u_t + i_h * V
    p_vn = v_new + (bos * HV + i_h) * V
    p_g = g + bos * stride_g_t + i_h
    # A sequence that writes no slot (a row, a padding sequence) needs no state after its last chunk:
    # for a one-chunk row that update was a third of the kernel's matmul work, all thrown away. The
    # last chunk runs after the loop, not under a branch inside it: a branch in the loop body kept
    # more values live (the 4-warp BV 64 configs spilled, bench/kernel_resources.py).
    write_slot = tl.load(write_slots + i_n)
    for i_t in range(tl.where(write_slot >= 0, NT, NT - 1)):  # the interpreter's range yields Python ints
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < L
        b_v = chunk_outputs(b_h, h, v_new, p_w, p_u, p_vn, boh, i_t, i_h, o_t, m_t, o_k, m_k, o_v, m_v, m_kv,
                            stride_w_t, stride_u_t, HV, K, V)
        b_g = tl.load(p_g + o_t * stride_g_t, mask=m_t, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + o_t[None, :] * stride_k_t + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_h = next_state(b_h, b_k, b_v, b_g, p_g, stride_g_t, i_t, L, m_t, BT)
    if (write_slot < 0) & (NT > 0):
        o_t = (NT - 1) * BT + tl.arange(0, BT)
        chunk_outputs(b_h, h, v_new, p_w, p_u, p_vn, boh, NT - 1, i_h, o_t, o_t < L, o_k, m_k, o_v, m_v, m_kv,
                      stride_w_t, stride_u_t, HV, K, V)

    write_slot_state(b_h, out_pool, write_slots, i_n, i_h, o_k, o_v, m_kv,
                     stride_o_s, stride_o_h, stride_o_k, stride_o_v)


_save, _restore = preserve_written_slots("out_pool", "write_slots")
_tuned_scan_kernel = triton.autotune(configs=SCAN_CONFIGS, key=["H", "HV", "K", "V", "N_CLASS", "T_CLASS"],
                                     pre_hook=_save, post_hook=_restore)(indexed_scan_fwd_kernel)


def indexed_scan(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    num_chunks: int,
    state_pool: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    *,
    out_pool: torch.Tensor | None = None,
    config: triton.Config | None = None,
    h: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state pass over chunks of CHUNK tokens.

    k:             [T, H, K] normalised keys (unit stride over K, heads contiguous)
    w:             [T, HV, K] WY-transformed keys (fla's recompute_w_u), k's dtype
    u:             [T, HV, V] WY-transformed values
    g:             [T, HV] fp32 chunk-local cumsum of the decay, in log2 units
    cu_seqlens:    [N + 1]; chunk_offsets [N + 1] (fla's prepare_chunk_offsets(cu_seqlens, 64))
    num_chunks:    total chunks over all sequences (len of fla's chunk_indices)
    state_pool:    [S, HV, K, V] fp32, any strides, read in place through read_slots [N] (-1: zeros)
    out_pool:      [S', HV, K, V] fp32 written through write_slots [N] (-1: no write); default state_pool
    h, v_new:      the outputs, preallocated (default: new). The sequences may be some of a pass's:
                   cu_seqlens and chunk_offsets are offsets into the whole pass's k, ..., h and v_new,
                   so slices of the pass's index tensors run those sequences alone (a phase).
    Returns (h [num_chunks, HV, K, V] in k's dtype: the state at each chunk start,
             v_new [T, HV, V] in u's dtype).
    """
    T, H, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    out_pool = state_pool if out_pool is None else out_pool
    if K > 256:
        raise ValueError(f"key head dim {K} > 256 is not supported (state [K, BV] lives in registers)")
    if HV % H:
        raise ValueError(f"value heads {HV} must be a multiple of key heads {H}")
    if tuple(w.shape) != (T, HV, K) or u.shape[0] != T or tuple(g.shape) != (T, HV):
        raise ValueError(f"w {tuple(w.shape)} must be [T={T}, HV={HV}, K={K}], u {tuple(u.shape)} [T, HV, V], "
                         f"g {tuple(g.shape)} [T, HV]")
    for name, t in (("k", k), ("w", w), ("u", u)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} {tuple(t.shape)} needs heads and features contiguous, strides {t.stride()}")
    for name, pool in (("state_pool", state_pool), ("out_pool", out_pool)):
        if pool.ndim != 4 or tuple(pool.shape[1:]) != (HV, K, V) or pool.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [S, HV={HV}, K={K}, V={V}], got {tuple(pool.shape)} {pool.dtype}")
    N = read_slots.shape[0]
    if write_slots.shape != (N,) or cu_seqlens.shape != (N + 1,) or chunk_offsets.shape != (N + 1,):
        raise ValueError(f"read_slots {tuple(read_slots.shape)}, write_slots {tuple(write_slots.shape)}, "
                         f"cu_seqlens {tuple(cu_seqlens.shape)}, chunk_offsets {tuple(chunk_offsets.shape)} "
                         f"must be [N], [N], [N + 1], [N + 1]")
    # index tensors (never the pools) must be contiguous: a strided index view costs a tiny copy
    read_slots, write_slots = read_slots.contiguous(), write_slots.contiguous()
    cu_seqlens, chunk_offsets = cu_seqlens.contiguous(), chunk_offsets.contiguous()
    if h is None:
        h = k.new_empty(num_chunks, HV, K, V)
    if v_new is None:
        v_new = torch.empty((T, HV, V), dtype=u.dtype, device=u.device)
    if tuple(h.shape) != (num_chunks, HV, K, V) or h.dtype != k.dtype or not h.is_contiguous() \
            or tuple(v_new.shape) != (T, HV, V) or v_new.dtype != u.dtype or not v_new.is_contiguous():
        raise ValueError(f"h {tuple(h.shape)} {h.dtype} must be contiguous [{num_chunks}, {HV}, {K}, {V}] {k.dtype}, "
                         f"v_new {tuple(v_new.shape)} {v_new.dtype} contiguous [{T}, {HV}, {V}] {u.dtype}")
    if N == 0:
        return h, v_new
    n_class, t_class = shape_class(N, T)
    args = (k, w, u, g, h, v_new, state_pool, out_pool, read_slots, write_slots, cu_seqlens, chunk_offsets,
            k.stride(0), w.stride(0), u.stride(0), g.stride(0), *state_pool.stride(), *out_pool.stride(),
            n_class, t_class)
    meta = dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=max(16, triton.next_power_of_2(K)))

    def grid(m):
        return (triton.cdiv(V, m["BV"]), N * HV)

    if config is None:
        _tuned_scan_kernel[grid](*args, **meta, **launch_options())
    else:
        indexed_scan_fwd_kernel[grid](*args, **meta, **config.all_kwargs(), **launch_options())
    return h, v_new


def indexed_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: DeltaGates,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    *,
    out_pool: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    scan_config: triton.Config | None = None,
    phases: Sequence[int] = (),
    start_states: StartStates | None = None,
) -> torch.Tensor:
    """Varlen chunked gated delta rule whose sequences start from (and end in) bank slots by index.

    q:             [T, H, K] raw queries, any strides with unit stride over K (L2-normalised inside)
    k:             [T, H, K] raw keys, likewise
    v:             [T, HV, V] values, HV a multiple of H (value head j reads key head j // (HV/H))
    gates:         [T, HV] the pass's gates (`DeltaGates`: the a and b projections, or g and beta given),
                   formed with q's and k's L2 norm and the gates' chunk cumsum in one launch (`prep`)
    cu_seqlens:    [N + 1] int64 sequence offsets
    state_pool:    [S, HV, K, V] fp32, read in place at read_slots [N] (-1: zero state)
    write_slots:   [N] slot of out_pool (default state_pool) that receives the final state (-1: none)
    scale:         query scale (default K^-0.5)
    chunk_indices: [NT, 2] fla's prepare_chunk_indices(cu_seqlens, 64); chunk_offsets: [N + 1]
                   fla's prepare_chunk_offsets(cu_seqlens, 64). Computed (host sync) when None; pass
                   them precomputed for CUDA graphs.
    scan_config:   run the state pass with this one config instead of the autotuner
    phases:        sequence counts of consecutive groups whose state passes run one after another
                   (a group may read the slots an earlier one writes: new documents, then rows over
                   them); the per-chunk steps run once over all. Default: one group.
    start_states:  (n0, n1) -> (pool, read slots) that sequences [n0, n1) start from, called right
                   before their state pass (the gathered variant copies the states there); default
                   state_pool and read_slots[n0:n1]
    Returns o: [T, HV, V] in v's dtype.
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, K], v {tuple(v.shape)} [T, HV, V]")
    T, H, K = q.shape
    HV = v.shape[1]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H} (v {tuple(v.shape)})")
    if tuple(gates.shape) != (T, HV):
        raise ValueError(f"gates {tuple(gates.shape)} must be [T={T}, HV={HV}]")
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK)
    if chunk_offsets is None:
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, CHUNK)
    scale = K ** -0.5 if scale is None else scale
    if T == 0:
        return v.new_empty(v.shape)

    # q, k normalised (contiguous [T, H, K] each) and g's chunk-local cumsum in log2 units (fla 0.6.0's
    # gate convention), in one launch
    q, k, g_cum, beta = delta_rule_inputs(q, k, gates, cu_seqlens, chunk_indices)
    g_cum = g_cum[None]  # [1, T, HV]
    # fla's WY recompute reads [T, HV, V] contiguous: the model's v already is (the conv writes it
    # as a block of its own, kev/ops/conv/indexed_conv.py); any other caller's v is copied here.
    v = v.contiguous()
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k[None], v=v[None], g=g_cum, beta=beta[None],
                                               cu_seqlens=cu_seqlens, chunk_size=CHUNK, chunk_indices=chunk_indices)
    N = read_slots.shape[0]
    counts = tuple(phases) or (N,)
    if sum(counts) != N or min(counts) < 0:
        raise ValueError(f"phases {counts} must be sequence counts summing to N={N}")
    V = v.shape[2]
    out_pool = state_pool if out_pool is None else out_pool
    h = k.new_empty(chunk_indices.shape[0], HV, K, V)
    v_new = torch.empty((T, HV, V), dtype=u.dtype, device=u.device)
    n0 = 0
    for n in counts:  # each group's state pass sees the slots the groups before it wrote
        n1 = n0 + n
        pool, read = start_states(n0, n1) if start_states is not None else (state_pool, read_slots[n0:n1])
        indexed_scan(k, w[0], u[0], g_cum[0], cu_seqlens[n0:n1 + 1], chunk_offsets[n0:n1 + 1], h.shape[0], pool,
                     read, write_slots[n0:n1], out_pool=out_pool,
                     config=scan_config, h=h, v_new=v_new)
        n0 = n1
    o = chunk_fwd_o(q=q[None], k=k[None], v=v_new[None], h=h[None], g=g_cum, scale=scale,
                    cu_seqlens=cu_seqlens, chunk_size=CHUNK, chunk_indices=chunk_indices)
    return o[0]
