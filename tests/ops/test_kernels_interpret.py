"""The project's own Triton kernels under TRITON_INTERPRET=1 on CPU, against the torch references.

The `interp` fixture imports fresh interpreted copies of the kernel modules and of fla
(`interpret_support.interpreted_kernels`) and puts the previous modules back afterwards. Every
autotuned kernel runs one pinned config there: the autotuner cannot benchmark without a GPU.

Shapes are tiny (K = V = 16, head_dim 32): the interpreter is slow. Parametrized by what changes
the code path: sequence lengths around the 64-token chunk (1, 63, 65), value-to-key head ratios 1
and 2 (and Kev-27B's 3 on one case; 3 for attention: a non-power-of-two row stack), strided/packed
views, repeated reads, skipped writes.
`test_compile_count_*` runs the real (non-interpreted) JIT front end against a fake Hopper target
and counts the compile keys over batch sizes 1..64 (no GPU needed, nothing is compiled).
"""

from collections import defaultdict
from pathlib import Path

import pytest
import torch
import triton

from interpret_support import FakeHopper, compiled_kernels
from kev.ops.delta_rule.naive import recurrent_gated_delta_rule
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta
from kev.ops.torch_ops import TorchOps
from kernel_support import rel_err




def packed(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


def strided_pool(g, shape, dtype=torch.float32):
    """A pool that is a non-contiguous view of a larger buffer (every other slot, padded inner dims)."""
    base = torch.randn((2 * shape[0] + 1, *[d + 3 for d in shape[1:]]), generator=g).to(dtype)
    view = base[1::2][(slice(None), *[slice(1, 1 + d) for d in shape[1:]])]
    assert not view.is_contiguous() and view.shape == shape
    return base, view


# (sequence lengths, read slots, write slots): repeated reads, -1 reads, -1 writes, read == write
CASES = {
    "T1": ([1], [3], [-1]),
    "T63": ([63], [-1], [2]),
    "T65-mixed": ([65, 1, 2, 63], [0, 0, -1, 5], [-1, 4, 1, 5]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_conv_matches_reference(interp, poisoned, case):
    from kev.ops.conv.naive import causal_conv_reference

    lens, read, write = CASES[case]
    g = torch.Generator().manual_seed(len(lens))
    C, W, S, T = 40, 4, 6, sum(lens)
    buf = torch.randn(T, C + 24, generator=g)
    x = buf[:, 8:8 + C]  # a packed column view, as q/k/v out of one projection
    weight = torch.randn(C, W, generator=g)
    base, pool = strided_pool(g, (S, C, W - 1))
    ref_pool = pool.clone()
    before = base.clone()
    cu = packed(lens)
    out = interp.conv.indexed_causal_conv(x=x, weight=weight, cu_seqlens=cu, conv_pool=pool,
                                          read_slots=torch.tensor(read), write_slots=torch.tensor(write))
    ref = causal_conv_reference(x, weight, cu.tolist(), ref_pool, read, write)
    assert rel_err(ref, out) <= 1e-5
    assert torch.equal(pool, ref_pool), "final conv states differ (or landed elsewhere)"
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[1::2, 1:1 + C, 1:W] = False
    assert torch.equal(base[outside], before[outside]), "a write landed outside the pool view"


@pytest.mark.parametrize("split", [0, 16, 40, 64], ids=lambda s: f"split{s}")
def test_conv_split_output_is_the_same_values_in_two_contiguous_blocks(interp, split):
    """`split` stores channels [0, s) and [s, C) as two contiguous blocks: bit-identical to the
    unsplit output's columns, whichever config's channel block straddles s (BC 128 > C here: one
    block holds both sides), with the same final conv states."""
    lens, read, write = CASES["T65-mixed"]
    g = torch.Generator().manual_seed(split)
    C, W, S = 64, 4, 6
    x = torch.randn(sum(lens), C + 8, generator=g)[:, 8:]
    weight = torch.randn(C, W, generator=g)
    _, pool = strided_pool(g, (S, C, W - 1))
    start = pool.clone()  # slot 5 is read and written: every call starts from these states
    pool_split = start.clone()
    kw = dict(weight=weight, cu_seqlens=packed(lens), read_slots=torch.tensor(read), write_slots=torch.tensor(write))
    whole = interp.conv.indexed_causal_conv(x=x, conv_pool=pool, **kw)
    head, tail = interp.conv.indexed_causal_conv(x=x, conv_pool=pool_split, split=split, **kw)
    assert head.is_contiguous() and tail.is_contiguous()
    assert head.shape == (x.shape[0], split) and tail.shape == (x.shape[0], C - split)
    assert torch.equal(head, whole[:, :split]) and torch.equal(tail, whole[:, split:])
    assert torch.equal(pool_split, pool)
    # four channel blocks of 16: whole blocks on either side, and one across s = 40
    small = triton.Config({"BC": 16, "BS": 16}, num_warps=1)
    head, tail = interp.conv.indexed_causal_conv(x=x, conv_pool=start.clone(), split=split, config=small, **kw)
    assert torch.equal(head, whole[:, :split]) and torch.equal(tail, whole[:, split:])
    with pytest.raises(ValueError, match="split"):
        interp.conv.indexed_causal_conv(x=x, conv_pool=pool, split=C + 1, **kw)


ROLL_CASES = {**CASES, "T130-6": ([130, 6, 3], [1, -1, 2], [1, 0, -1])}  # a third chunk of 2 rows, 6 and 3 rows


@pytest.mark.parametrize("case", ROLL_CASES, ids=list(ROLL_CASES))
def test_conv_rolling_configs_give_the_tile_configs_bits(interp, case):
    """A ROLL config (four rows a step, the window's earlier rows carried) stores the very bits of
    the tile steps, in both output blocks, with the same final conv states: channel blocks of 16 and
    32 over 40 channels (a partial block), the split inside a block, sequences of 1-130 tokens (one
    to three chunks, shorter than the window, every remainder of a four-row step), read == write
    slots. Kernel size 4 only: the autotuner drops ROLL configs for any other."""
    lens, read, write = ROLL_CASES[case]
    g = torch.Generator().manual_seed(7 + len(lens))
    C, W, S = 40, 4, 6
    x = torch.randn(sum(lens), C + 8, generator=g).bfloat16()[:, 8:]
    weight = torch.randn(C, W, generator=g).bfloat16()
    _, pool = strided_pool(g, (S, C, W - 1))
    start = pool.bfloat16()
    kw = dict(x=x, weight=weight, cu_seqlens=packed(lens), read_slots=torch.tensor(read),
              write_slots=torch.tensor(write), split=24)
    tile_pool = start.clone()
    tile = interp.conv.indexed_causal_conv(conv_pool=tile_pool, config=triton.Config({"BC": 16, "BS": 16}), **kw)
    for BC in (16, 32):
        roll_pool = start.clone()
        roll = interp.conv.indexed_causal_conv(conv_pool=roll_pool, **kw,
                                               config=triton.Config({"BC": BC, "BS": 1, "ROLL": True}))
        assert torch.equal(roll[0], tile[0]) and torch.equal(roll[1], tile[1]), f"BC {BC}"
        assert torch.equal(roll_pool, tile_pool), f"BC {BC}: final conv states"
    rolling = [c for c in interp.conv.CONV_CONFIGS_ALL if c.kwargs.get("ROLL")]
    assert rolling and interp.conv._rolling_needs_four_taps(rolling, {}, W=4) == rolling
    assert interp.conv._rolling_needs_four_taps(rolling, {}, W=3) == []


def test_every_conv_config_reads_and_writes_only_its_tensors_past_no_op_entries(interp):
    """A CUDA-graph key's static chunk list runs on past its last sequence with no-op entries
    (`kev.exec.static_pass.packed_chunk_lists`): chunks with no rows, starting up to thousands of
    rows past the pass's last token. Every conv config, tile and ROLL, must touch nothing outside its
    tensors there (a081b28's ROLL preload read the three rows before each such chunk: the bank's first
    capture faulted on an H100), and the real rows must still match the reference."""
    from interpret_support import accesses_inside
    from kernel_support import packed_chunks
    from kev.ops.conv.naive import causal_conv_reference

    lens, T, slots, entries = [70, 5], 80, 4, 40  # 2 + 1 chunks, the 5-token padding's 1, then 36 no-ops
    chunks, _ = packed_chunks(lens, T, slots, 64, entries)
    assert int(chunks[-1, 1]) * 64 >= 30 * 64, "no-op entries run far past the pass"
    cu = torch.tensor([0, 70, 75, 80, 80])
    read, write = torch.tensor([2, -1, -1, -1]), torch.tensor([1, 0, -1, -1])
    g = torch.Generator().manual_seed(11)
    C, W, S, split = 40, 4, 3, 24
    buf = torch.randn(T, C + 8, generator=g).bfloat16()  # x is all of it but 8 columns: no rows to spare
    x = buf[:, 8:]
    weight = torch.randn(C, W, generator=g).bfloat16()
    start = torch.randn(S, C, W - 1, generator=g).bfloat16()
    ref_pool = start.float()
    ref = causal_conv_reference(x[:75].float(), weight.float(), [0, 70, 75], ref_pool, [2, -1], [1, 0])
    for config in interp.conv.CONV_CONFIGS_ALL:
        pool, flat = start.clone(), torch.empty(T * C, dtype=torch.bfloat16)
        out = (flat[: T * split].view(T, split), flat[T * split:].view(T, C - split))
        with accesses_inside(buf, weight, pool, cu, read, write, chunks, flat):
            head, tail = interp.conv.indexed_causal_conv(x=x, weight=weight, cu_seqlens=cu, conv_pool=pool,
                                                         read_slots=read, write_slots=write, chunk_indices=chunks,
                                                         split=split, out=out, config=config)
        y = torch.cat([head, tail], dim=1)[:75].float()
        assert rel_err(ref, y) <= 1e-2, config
        assert rel_err(ref_pool[:2], pool[:2].float()) <= 1e-2 and torch.equal(pool[2], start[2]), config


def scan_reference(k, w, u, g, lens, h0s):
    """The state pass in plain torch (fp64): per sequence and chunk of 64, what the h kernel computes."""
    hs, v_new, finals = [], torch.empty(u.shape, dtype=torch.float64), []
    s = 0
    HV, H = u.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(HV // H, dim=1)
    for L, S in zip(lens, h0s):
        S = S.double().clone()
        for c in range(0, L, 64):
            e = min(c + 64, L)
            hs.append(S.clone())
            bw, bu, bk, bg = w[s + c:s + e].double(), u[s + c:s + e].double(), kk[s + c:s + e], g[s + c:s + e].double()
            vn = bu - torch.einsum("thk,hkv->thv", bw, S)
            v_new[s + c:s + e] = vn
            decay = torch.exp2(bg[-1][None] - bg)  # [C, HV]
            S = S * torch.exp2(bg[-1])[:, None, None] + torch.einsum("thk,thv->hkv", bk, vn * decay[..., None])
        finals.append(S)
        s += L
    return torch.stack(hs), v_new, finals


# Value heads per key head: 1 and 2 on every case; 3 (Kev-27B's 48 / 16) on the case with the most
# sequences and chunk boundaries (the interpreter is slow; the GPU suite runs 3 on its whole model).
RATIO_CASES = [pytest.param(case, ratio, id=f"{case}-hv_per_h={ratio}") for ratio in (1, 2) for case in CASES] + [
    pytest.param("T65-mixed", 3, id="T65-mixed-hv_per_h=3")]


@pytest.mark.parametrize("case,ratio", RATIO_CASES)
def test_state_pass_kernel_matches_reference(interp, poisoned, case, ratio):
    lens, read, write = CASES[case]
    g = torch.Generator().manual_seed(10 + ratio)
    H, K, V, S, T = 2, 16, 16, 6, sum(lens)
    HV = H * ratio
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    w = torch.randn(T, HV, K, generator=g) * 0.3
    u = torch.randn(T, HV, V, generator=g)
    cu = packed(lens)
    gate = torch.cat([(-torch.rand(L, HV, generator=g) * 0.3).cumsum(0) % -4 for L in lens])  # any chunk-local values
    base, pool = strided_pool(g, (S, HV, K, V))
    h0s = [pool[r].clone() if r >= 0 else torch.zeros(HV, K, V) for r in read]
    offsets = torch.tensor([0, *torch.tensor([-(-L // 64) for L in lens]).cumsum(0).tolist()])
    before = pool.clone()
    h, v_new = interp.scan.indexed_scan(k, w, u, gate, cu, offsets, int(offsets[-1]), pool, torch.tensor(read),
                                        torch.tensor(write))
    ref_h, ref_v, finals = scan_reference(k, w, u, gate, lens, h0s)
    assert rel_err(ref_h, h) <= 1e-5 and rel_err(ref_v, v_new) <= 1e-5
    expect = before.clone()
    for n, slot in enumerate(write):
        if slot >= 0:
            expect[slot] = finals[n].float()
    assert rel_err(expect, pool) <= 1e-5
    untouched = [s for s in range(S) if s not in write]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("case,ratio", RATIO_CASES)
def test_indexed_delta_rule_matches_recurrence(interp, poisoned, case, ratio):
    lens, read, write = CASES[case]
    g = torch.Generator().manual_seed(20 + ratio)
    H, K, V, S, T = 2, 16, 16, 6, sum(lens)
    HV = H * ratio
    qkv = torch.randn(T, 2 * H * K + HV * V + 5, generator=g)  # packed, with padding: strided views
    q = qkv[:, :H * K].unflatten(1, (H, K))
    k = qkv[:, H * K:2 * H * K].unflatten(1, (H, K))
    v = qkv[:, 2 * H * K:2 * H * K + HV * V].unflatten(1, (HV, V))
    gate = -torch.rand(T, HV, generator=g) * 0.5
    beta = torch.rand(T, HV, generator=g)
    gates = DeltaGates.given(gate, beta)
    _, pool = strided_pool(g, (S, HV, K, V))
    pool.mul_(0.3)
    before = pool.clone()
    cu = packed(lens)
    o = interp.scan.indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=cu, state_pool=pool,
                                                   read_slots=torch.tensor(read), write_slots=torch.tensor(write))
    # the reference: normalise like TorchOps, expand heads, recur token by token in fp64
    qn = torch.nn.functional.normalize(q, dim=-1, eps=0).repeat_interleave(ratio, 1) * K ** -0.5
    kn = torch.nn.functional.normalize(k, dim=-1, eps=0).repeat_interleave(ratio, 1)
    expect = before.clone()
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        h0 = before[read[n]] if read[n] >= 0 else torch.zeros(HV, K, V)
        ro, rs = recurrent_gated_delta_rule(qn[s:e], kn[s:e], v[s:e], gate[s:e], beta[s:e], h0.double())
        assert rel_err(ro, o[s:e]) <= 2e-3, f"sequence {n}"
        if write[n] >= 0:
            expect[write[n]] = rs.float()
    assert rel_err(expect, pool) <= 2e-3


# Both under `pytest -m slow` (~20 s each): tests/exec/test_one_sweep.py checks a phased sweep bitwise
# through the torch ops in CI, and the GPU suite these kernels, indexed == gathered.
@pytest.mark.slow
@pytest.mark.parametrize("gathered", [False, True], ids=["indexed", "gathered"])
def test_phased_delta_rule_equals_its_phases_run_alone(interp, poisoned, gathered):
    """A joined pass (new documents, then rows reading the slots they write): the state passes run
    phase by phase, everything else once over all tokens; outputs and pools equal the two phases
    run as passes of their own, bit for bit (the per-chunk steps work chunk by chunk). The gathered
    variant copies the rows' start states right before their phase, after the documents wrote them."""
    g = torch.Generator().manual_seed(31)
    H, HV, K, V, S = 2, 4, 16, 16, 6
    phases = [([65, 2], [-1, 3], [1, 4]), ([1, 70, 5], [1, 4, 3], [-1, -1, -1])]  # rows read slots 1, 4 and 3
    lens = [n for ls, _, _ in phases for n in ls]
    T = sum(lens)
    q, k = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g)
    v, beta = torch.randn(T, HV, V, generator=g), torch.rand(T, HV, generator=g)
    gate = -torch.rand(T, HV, generator=g) * 0.5
    gates = DeltaGates.given(gate, beta)
    _, pool = strided_pool(g, (S, HV, K, V))
    pool.mul_(0.3)
    pool_alone = pool.clone()
    idx = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    read, write = idx([r for _, rs, _ in phases for r in rs]), idx([w for _, _, ws in phases for w in ws])
    if gathered:
        ops = interp.gathered_ops.GatheredOps()
        meta = PassMeta(cu_seqlens=packed(lens), read_slots=read, write_slots=write,
                        prefix_lens=torch.zeros(len(lens), dtype=torch.int64),
                        block_table=torch.zeros(len(lens), 1, dtype=torch.int32), phases=(2, 3))
        joined = ops.gated_delta_rule(q, k, v, gates, meta, pool)
    else:
        joined = interp.scan.indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=packed(lens),
                                                            state_pool=pool, read_slots=read, write_slots=write,
                                                            phases=(2, 3))
    start = 0
    for ls, rs, ws in phases:
        end = start + sum(ls)
        alone = interp.scan.indexed_chunk_gated_delta_rule(
            q=q[start:end], k=k[start:end], v=v[start:end], gates=DeltaGates.given(gate[start:end], beta[start:end]),
            cu_seqlens=packed(ls), state_pool=pool_alone, read_slots=idx(rs), write_slots=idx(ws))
        assert torch.equal(joined[start:end], alone)
        start = end
    assert torch.equal(pool, pool_alone)
    with pytest.raises(ValueError, match="phases"):
        interp.scan.indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=packed(lens),
                                                   state_pool=pool, read_slots=read, write_slots=write, phases=(2, 2))


def test_conv_writes_phase_slices_of_one_output(interp, poisoned):
    """`out=`: two phases' convs store their token slices of one split output (the second reading
    the slot the first writes); the same bits as each phase's own output."""
    g = torch.Generator().manual_seed(12)
    C, W, split = 48, 4, 32
    x = torch.randn(80, C, generator=g)
    weight = torch.randn(C, W, generator=g)
    pool = torch.randn(4, C, W - 1, generator=g)
    pool_alone = pool.clone()
    flat = torch.full((80 * C,), float("nan"))
    head, tail = flat[: 80 * split].view(80, split), flat[80 * split:].view(80, C - split)
    phases = [(0, 66, [66], [-1], [2]), (66, 80, [10, 4], [2, 0], [-1, -1])]
    for s, e, lens, rs, ws in phases:
        kw = dict(weight=weight, cu_seqlens=packed(lens), read_slots=torch.tensor(rs), write_slots=torch.tensor(ws))
        interp.conv.indexed_causal_conv(x=x[s:e], conv_pool=pool, split=split, out=(head[s:e], tail[s:e]), **kw)
        own_head, own_tail = interp.conv.indexed_causal_conv(x=x[s:e], conv_pool=pool_alone, split=split, **kw)
        assert torch.equal(head[s:e], own_head) and torch.equal(tail[s:e], own_tail)
    assert torch.equal(pool, pool_alone) and not flat.isnan().any()
    kw = dict(weight=weight, cu_seqlens=packed([80]), read_slots=torch.tensor([-1]), write_slots=torch.tensor([-1]))
    with pytest.raises(ValueError, match="after its first"):
        swapped = flat[: 80 * (C - split)].view(80, C - split), flat[80 * (C - split):].view(80, split)
        interp.conv.indexed_causal_conv(x=x, conv_pool=pool, split=split, out=swapped[::-1], **kw)
    with pytest.raises(ValueError, match="contiguous"):
        interp.conv.indexed_causal_conv(x=x, conv_pool=pool, split=split, out=(head[:40], tail), **kw)


def test_packed_views_bit_identical(interp):
    """Packed q/k/v column views give bit-identical outputs to contiguous copies."""
    g = torch.Generator().manual_seed(5)
    H, HV, K, V, T = 2, 4, 16, 16, 70
    qkv = torch.randn(T, 2 * H * K + HV * V, generator=g)
    q, k = qkv[:, :H * K].unflatten(1, (H, K)), qkv[:, H * K:2 * H * K].unflatten(1, (H, K))
    v = qkv[:, 2 * H * K:].unflatten(1, (HV, V))
    gate, beta = -torch.rand(T, HV, generator=g), torch.rand(T, HV, generator=g)
    pool = torch.randn(3, HV, K, V, generator=g)
    gates = DeltaGates.given(gate, beta)
    cu, read, write = torch.tensor([0, 30, 70]), torch.tensor([1, 1]), torch.tensor([-1, -1])
    a = interp.scan.indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=cu, state_pool=pool,
                                                   read_slots=read, write_slots=write)
    b = interp.scan.indexed_chunk_gated_delta_rule(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                                                   gates=gates, cu_seqlens=cu, state_pool=pool.clone(),
                                                   read_slots=read, write_slots=write)
    assert torch.equal(a, b)
    weight = torch.randn(qkv.shape[1] - 8, 4, generator=g)
    cpool = torch.randn(3, weight.shape[0], 3, generator=g)
    ya = interp.conv.indexed_causal_conv(x=qkv[:, 8:], weight=weight, cu_seqlens=cu, conv_pool=cpool,
                                         read_slots=read, write_slots=write)
    yb = interp.conv.indexed_causal_conv(x=qkv[:, 8:].contiguous(), weight=weight, cu_seqlens=cu, conv_pool=cpool,
                                         read_slots=read, write_slots=write)
    assert torch.equal(ya, yb)


@pytest.mark.parametrize("raw,dtype", [(True, torch.float32), (True, torch.bfloat16), (False, torch.float32)],
                         ids=["projections", "projections-bf16", "given"])
@pytest.mark.parametrize("ratio", [1, 3])
def test_delta_rule_inputs_in_one_launch(interp, poisoned, raw, dtype, ratio):
    """q and k normalised (from column views) and the gates formed and summed per chunk, in one
    launch, against the fp32 reference: sequences of 1, 63, 64, 65 and 130 tokens, with empty
    sequences and a chunk-list entry past its sequence's end (a CUDA-graph key's no-op)."""
    g = torch.Generator().manual_seed(40 + ratio)
    H, K = 3, 16
    HV = H * ratio
    lens = [1, 63, 0, 64, 65, 130]
    T = sum(lens)
    block = torch.randn(T, 2 * H * K + 2 * HV + 8, generator=g).to(dtype)[:, 8:]  # column views, as the model's
    q, k = block[:, :H * K].unflatten(1, (H, K)), block[:, H * K:2 * H * K].unflatten(1, (H, K))
    if raw:
        a, b = block[:, 2 * H * K:2 * H * K + HV] * 8, block[:, 2 * H * K + HV:]  # both softplus branches
        gates = DeltaGates(a, b, torch.randn(HV, generator=g), torch.randn(HV, generator=g))
    else:
        gates = DeltaGates.given(-torch.rand(T, HV, generator=g), torch.rand(T, HV, generator=g))
    cu = packed(lens)
    chunks = interp.scan.prepare_chunk_indices(cu, 64)
    chunks = torch.cat([chunks, torch.tensor([[5, 7]])])  # past sequence 5's end: must change nothing
    qn, kn, gc, beta = interp.prep.delta_rule_inputs(q, k, gates, cu, chunks)
    rq, rk, rg, rbeta = interp.prep.delta_rule_inputs_reference(q, k, gates, cu)
    assert qn.is_contiguous() and kn.is_contiguous() and gc.dtype == torch.float32
    # bf16: the interpreter's casts truncate where the GPU rounds to nearest (the GPU test checks closely)
    tol = 1e-6 if dtype == torch.float32 else 1.5e-2
    assert qn.dtype == beta.dtype == dtype
    assert rel_err(rq, qn) <= tol and rel_err(rk, kn) <= tol and rel_err(rbeta, beta) <= tol
    assert rel_err(rg, gc) <= 1e-5
    assert torch.allclose(qn.float(), torch.nn.functional.normalize(q.float(), dim=-1), atol=10 * tol)
    c = torch.Tensor.contiguous
    assert all(torch.equal(x, y) for x, y in zip(  # column views read in place: the same bits as copies
        (qn, kn, gc, beta), interp.prep.delta_rule_inputs(c(q), c(k), gates if not raw else DeltaGates(
            c(gates.a), c(gates.b), gates.A_log, gates.dt_bias), cu, chunks)))
    with pytest.raises(ValueError, match="multiple of H"):
        interp.prep.delta_rule_inputs(q, k, DeltaGates.given(gc[:, :1].expand(T, 2).contiguous(), beta[:, :2]),
                                      cu, chunks)
    with pytest.raises(ValueError, match="fp32"):
        interp.prep.delta_rule_inputs(q, k, DeltaGates.given(gc.double(), beta), cu, chunks)


def test_delta_gates_take_projections_or_given_values():
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="DeltaGates takes"):
        DeltaGates(x, x)
    with pytest.raises(ValueError, match="DeltaGates takes"):
        DeltaGates(x, x, x[0], x[0], g=x, beta=x)
    assert DeltaGates.given(x, x).values() == (x, x) and DeltaGates(x, x, x[0], x[0]).raw


ATTN_CASES = {  # (own lengths, prefix lengths, write slots)
    "T1-prefix40": ([1], [40], [-1]),
    "T63-noprefix-write": ([63], [0], [0]),
    "T65-mixed": ([65, 1, 17], [5, 40, 16], [1, -1, 2]),
    "T9-longprefix": ([4, 5], [1100, 127], [-1, 1]),  # split mode: spans of 3 key tiles, a short last one
}


def paged_meta(g, lens, prefixes, write, NB, BS, MB=72):
    """A PassMeta of sequences with `prefixes` stored tokens each, their pages scattered over NB."""
    perm = torch.randperm(NB, generator=g)
    table, used = [], 0
    for L, P in zip(lens, prefixes):
        need = -(-(P + L) // BS)
        table.append(perm[used:used + need].tolist() + [-1] * (MB - need))
        used += need
    return PassMeta(cu_seqlens=packed(lens), read_slots=torch.zeros(len(lens), dtype=torch.int64),
                    write_slots=torch.tensor(write), prefix_lens=torch.tensor(prefixes),
                    block_table=torch.tensor(table, dtype=torch.int32))


# Every value split at the widest grouping, every grouping at nv=1; the other pairs under `-m slow`
# (CI's time budget; the GPU suite runs the kernels at every served shape).
HEADS_NV = [pytest.param(h, nv, id=f"hq{h[0]}-hkv{h[1]}-nv{nv}",
                         marks=() if h == (6, 2) or nv == 1 else pytest.mark.slow)
            for h in [(2, 2), (4, 2), (6, 2)] for nv in [1, 2, 4]]


@pytest.mark.parametrize("split", [False, True], ids=["one-program", "split"])
@pytest.mark.parametrize("heads,nv", HEADS_NV)
@pytest.mark.parametrize("case", ATTN_CASES, ids=list(ATTN_CASES))
def test_paged_prefix_attention_matches_reference(interp, poisoned, case, heads, nv, split):
    """nv: the value features split over that many programs (an autotuned config; 4 needs a head
    dim of 64 or more, see `valid_configs`). split: a program per prefix span, then the finish
    kernel (the prefixes here span 1-3 key tiles: some spans are empty)."""
    lens, prefixes, write = ATTN_CASES[case]
    HQ, HKV = heads
    D, BS, NB = 64 if nv == 4 else 32, 16, 96
    g = torch.Generator().manual_seed(HQ + len(lens))
    T = sum(lens)
    q = torch.randn(T, HQ, D + 8, generator=g)[..., 4:4 + D]  # strided views
    k = torch.randn(T, HKV, D, generator=g)
    v = torch.randn(T, HKV, D + 2, generator=g)[..., :D]
    kbase, key_pages = strided_pool(g, (NB, BS, HKV, D))
    _, value_pages = strided_pool(g, (NB, BS, HKV, D))
    meta = paged_meta(g, lens, prefixes, write, NB, BS)
    ref_k, ref_v = key_pages.clone(), value_pages.clone()
    kbefore = kbase.clone()
    out = interp.attn.paged_prefix_attention(q=q, k=k, v=v, cu_seqlens=meta.cu_seqlens, prefix_lens=meta.prefix_lens,
                                             key_pages=key_pages, value_pages=value_pages,
                                             block_table=meta.block_table, write_slots=meta.write_slots,
                                             config=interp.attn.triton.Config({"NV": nv}, num_warps=4, num_stages=1),
                                             split=split)
    ref = TorchOps().attention(q, k, v, meta, ref_k, ref_v)
    assert rel_err(ref, out) <= 1e-5
    assert torch.equal(key_pages, ref_k) and torch.equal(value_pages, ref_v)
    outside = torch.ones_like(kbase, dtype=torch.bool)
    outside[1::2, 1:1 + BS, 1:1 + HKV, 1:1 + D] = False
    assert torch.equal(kbase[outside], kbefore[outside])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["one-program", "split"])
def test_the_output_gate_in_the_attentions_store(interp, poisoned, split, dtype):
    """gate=: the attention's store gives o * sigmoid(gate), bit for bit what the standalone gate
    kernel gives after the ungated attention (the same roundings), into a token slice of a larger
    output with out=, the pages written the same; TorchOps' reference gates the same way."""
    lens, prefixes, write = ATTN_CASES["T65-mixed"]
    HQ, HKV, D, BS, NB = 6, 2, 32, 16, 96
    g = torch.Generator().manual_seed(61)
    T = sum(lens)
    qg = torch.randn(T, HQ, 2 * D, generator=g).to(dtype)  # queries and gates interleaved per head, as the model's
    q, gate = qg[..., :D], qg[..., D:]
    k, v = torch.randn(T, HKV, D, generator=g).to(dtype), torch.randn(T, HKV, D, generator=g).to(dtype)
    _, key_pages = strided_pool(g, (NB, BS, HKV, D))
    _, value_pages = strided_pool(g, (NB, BS, HKV, D))
    key_pages, value_pages = key_pages.to(dtype), value_pages.to(dtype)
    meta = paged_meta(g, lens, prefixes, write, NB, BS)
    pages = [(key_pages.clone(), value_pages.clone()) for _ in range(2)]

    def attend(kp, vp, **kw):
        return interp.attn.paged_prefix_attention(q=q, k=k, v=v, cu_seqlens=meta.cu_seqlens,
                                                  prefix_lens=meta.prefix_lens, key_pages=kp, value_pages=vp,
                                                  block_table=meta.block_table, write_slots=meta.write_slots,
                                                  split=split, **kw)

    apart = interp.activations.sigmoid_mul(attend(*pages[0]), gate)
    whole = torch.full((T + 7, HQ, D), float("nan"), dtype=dtype)
    fused = attend(*pages[1], gate=gate, out=whole[3:3 + T])
    assert fused.data_ptr() == whole[3].data_ptr() and torch.equal(fused, apart)
    assert whole[:3].isnan().all() and whole[3 + T:].isnan().all()
    assert all(torch.equal(a, b) for a, b in zip(pages[0], pages[1]))
    if dtype == torch.float32:  # (the interpreter's bf16 dots are not the GPU's: the GPU suite checks bf16)
        ref = TorchOps().attention(q, k, v, meta, key_pages.clone(), value_pages.clone(), gate=gate)
        assert rel_err(ref, fused) <= 1e-5
    with pytest.raises(ValueError, match="gate"):
        attend(*pages[1], gate=gate[:, :, :8])


@pytest.mark.parametrize("heads", [(2, 2), (6, 2)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("case", ATTN_CASES, ids=list(ATTN_CASES))
def test_paged_store_writes_what_attention_writes(interp, poisoned, case, heads):
    """The store-only kernel (a state pass's last layer) leaves the very pages the attention kernel
    leaves, bit for bit, and so does the torch reference's `store_kv`; nothing else is touched."""
    lens, prefixes, write = ATTN_CASES[case]
    HQ, HKV = heads
    D, BS, NB = 32, 16, 96
    g = torch.Generator().manual_seed(7 * HQ + len(lens))
    T = sum(lens)
    q = torch.randn(T, HQ, D, generator=g)
    k = torch.randn(T, HKV, D + 8, generator=g)[..., 2:2 + D]  # strided views
    v = torch.randn(T, HKV, D, generator=g)
    _, key_pages = strided_pool(g, (NB, BS, HKV, D))
    _, value_pages = strided_pool(g, (NB, BS, HKV, D))
    meta = paged_meta(g, lens, prefixes, write, NB, BS)
    pages = {name: (key_pages.clone(), value_pages.clone()) for name in ("attention", "store", "torch")}
    attn = interp.attn
    attn.paged_prefix_attention(q=q, k=k, v=v, cu_seqlens=meta.cu_seqlens, prefix_lens=meta.prefix_lens,
                                key_pages=pages["attention"][0], value_pages=pages["attention"][1],
                                block_table=meta.block_table, write_slots=meta.write_slots)
    chunks = attn.prepare_chunk_indices(meta.cu_seqlens, attn.query_block(HQ // HKV))
    attn.paged_store(k, v, meta.cu_seqlens, meta.prefix_lens, *pages["store"], meta.block_table, meta.write_slots,
                     chunk_indices=chunks, group=HQ // HKV)
    TorchOps().store_kv(k, v, meta, *pages["torch"], group=HQ // HKV)
    for name in ("store", "torch"):
        assert torch.equal(pages[name][0], pages["attention"][0]), name
        assert torch.equal(pages[name][1], pages["attention"][1]), name
    if any(w >= 0 for w in write):
        assert not torch.equal(pages["store"][0], key_pages), "nothing was stored"


def attention_vs_reference(interp, seed, lens, prefixes, chunk_block=None, **kwargs) -> float:
    """Relative error of `paged_prefix_attention(**kwargs)` (4 query heads over 2 kv heads, nothing
    stored) against the torch reference; `chunk_block`: chunk lists built for that query block."""
    g = torch.Generator().manual_seed(seed)
    HQ, HKV, D, BS, NB = 4, 2, 32, 16, 96
    T, N = sum(lens), len(lens)
    q = torch.randn(T, HQ, D, generator=g)
    k, v = torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g)
    _, key_pages = strided_pool(g, (NB, BS, HKV, D))
    _, value_pages = strided_pool(g, (NB, BS, HKV, D))
    meta = paged_meta(g, lens, prefixes, [-1] * N, NB, BS)
    attn = interp.attn
    if chunk_block is not None:
        kwargs["chunk_indices"] = attn.prepare_chunk_indices(meta.cu_seqlens, chunk_block)
    out = attn.paged_prefix_attention(q=q, k=k, v=v, cu_seqlens=meta.cu_seqlens, prefix_lens=meta.prefix_lens,
                                      key_pages=key_pages, value_pages=value_pages, block_table=meta.block_table,
                                      write_slots=meta.write_slots, **kwargs)
    return rel_err(TorchOps().attention(q, k, v, meta, key_pages.clone(), value_pages.clone()), out)


@pytest.mark.parametrize("spans", [1, 3, 16])
def test_split_attention_at_other_span_counts(interp, spans):
    """`spans` (benchmarks only): split mode over 1, 3 or 16 prefix spans (16: most of them empty
    for a 3-tile prefix) still matches the reference."""
    assert attention_vs_reference(interp, spans, [4, 5], [1100, 40], split=True, spans=spans) <= 1e-5


@pytest.mark.parametrize("split", [False, True], ids=["one-program", "split"])
@pytest.mark.parametrize("block_m", [8, 64])
def test_attention_at_other_query_blocks(interp, split, block_m):
    """`block_m` (benchmarks only): 8 or 64 query tokens a program instead of `query_block`'s 32
    (2 heads a group), with chunk lists built for it, still matches the reference."""
    assert attention_vs_reference(interp, block_m, [70, 5], [300, 40], chunk_block=block_m, split=split,
                                  block_m=block_m) <= 1e-5


def test_attention_configs_keep_a_dot_operand():
    """The autotuner only tries value splits whose slice is still a dot operand (>= 16 features)."""
    from kev.ops.attention.paged_prefix import valid_configs
    from triton import Config

    configs = [Config({"NV": nv}) for nv in (1, 2, 4)]
    assert [c.kwargs["NV"] for c in valid_configs(configs, {}, BD=32)] == [1, 2]
    assert [c.kwargs["NV"] for c in valid_configs(configs, {}, BD=256)] == [1, 2, 4]


@pytest.fixture(scope="module")
def tiny_model():
    from random_models import random_model, tiny_config

    return random_model(tiny_config(hv_per_h=2), seed=3)


@pytest.mark.slow  # ~40 s interpreted; every kernel above is checked alone, the whole model bit for bit on the GPU
def test_model_indexed_equals_gathered_and_reference(interp, tiny_model):
    """Whole model, rows continuing stored documents: Triton indexed == gathered bit for bit, ~= torch.
    Strided pools, repeated read slots, a long document state-passed in chunks carried in its slot."""
    from kernel_support import stored_then_rows

    model = tiny_model
    g = torch.Generator().manual_seed(9)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (40, 150)]
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 17, 65)]
    slots = [2, 0]
    read = torch.tensor([0, 7, 2, 7, 0, 7])[::2]  # a strided index view: slots 0, 2, 0
    doc_lens = torch.tensor([150, 0, 40, 0])
    named = (("torch", TorchOps()), ("indexed", interp.triton_ops.TritonOps()),
             ("gathered", interp.gathered_ops.GatheredOps()))
    outs, banks = stored_then_rows(model, named, docs, slots, rows, read, doc_lens, max_doc_tokens=160)
    assert torch.equal(outs["indexed"], outs["gathered"])
    assert rel_err(outs["torch"], outs["indexed"]) <= 2e-3
    for a, b in zip(banks["torch"].tensors(), banks["indexed"].tensors()):
        assert rel_err(a, b) <= 2e-3


@pytest.mark.slow  # ~60 s interpreted; the GPU suite checks the joined sweep indexed == gathered bitwise, test_one_sweep.py on torch
def test_model_one_sweep_indexed_equals_gathered_and_reference(interp, tiny_model):
    """Whole model, one sweep (`Passes.sweep`): new documents, then rows over them and
    over a stored one, in one pass over the weights (the joined delta rule, the last layer's
    K/V-only store). Triton indexed == gathered bit for bit, both ~= torch and ~= two passes."""
    from kev.bank.bank import Bank
    from kev.exec.batch import RowBatch
    from kev.exec.passes import Passes

    g = torch.Generator().manual_seed(4)
    stored_doc = [torch.randint(0, 300, (90,), generator=g).tolist()]
    new_docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (66, 3)]
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 70, 2)]
    outs, banks = {}, {}
    named = (("torch", TorchOps()), ("indexed", interp.triton_ops.TritonOps()),
             ("gathered", interp.gathered_ops.GatheredOps()))
    for name, ops in named:
        for sweep in (True, False):
            bank = Bank.allocate(tiny_model.cfg, num_slots=6, num_blocks=64, block_size=16)
            runner = Passes(tiny_model, bank, ops)
            old = bank.alloc(90)
            runner.state_pass(stored_doc, [old])
            new = [bank.alloc(len(d)) for d in new_docs]
            owners = [new[0], old, new[1]]
            batch = RowBatch.build(rows, owners, [66, 90, 3], [[len(r) - 1, 0] for r in rows])
            if sweep:
                outs[name, sweep] = runner.sweep(new_docs, new, batch)
            else:
                runner.state_pass(new_docs, new)
                outs[name, sweep] = runner.row_pass(batch)
            banks[name, sweep] = [t.clone() for t in bank.pools.tensors()]
    assert torch.equal(outs["indexed", True], outs["gathered", True])
    assert all(torch.equal(a, b) for a, b in zip(banks["indexed", True], banks["gathered", True]))
    for name in ("indexed", "torch"):
        assert rel_err(outs["torch", False], outs[name, True]) <= 2e-3, name
        for a, b in zip(banks["torch", False], banks[name, True]):
            assert rel_err(a, b) <= 2e-3, name


# ---- compile count: the real JIT front end, a fake Hopper target, nothing compiled ----

@pytest.fixture
def compiled_modules():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check (the GPU test counts real compiles)")
    with compiled_kernels() as mods:
        yield mods


def test_compile_count_batch_agnostic(compiled_modules, monkeypatch):
    """Batch size, row count, token count, pool size and slot count change no compile key."""
    import triton
    from triton import knobs
    from triton.runtime.driver import driver

    indexed_conv, indexed_scan, paged_prefix = compiled_modules.conv, compiled_modules.scan, compiled_modules.attn
    prep = compiled_modules.prep
    kernels = [indexed_conv.indexed_conv_fwd_kernel, indexed_scan.indexed_scan_fwd_kernel,
               prep.delta_rule_prep_kernel, paged_prefix.paged_prefix_attn_fwd_kernel,
               paged_prefix.paged_prefix_span_kernel, paged_prefix.paged_prefix_finish_kernel]
    for kern in kernels:  # fresh binders against the fake target; the originals come back afterwards
        monkeypatch.setattr(kern, "device_caches", defaultdict(kern.create_binder))
    monkeypatch.setattr(driver, "_active", FakeHopper())
    keys = defaultdict(set)

    def record(*, key, fn, **_):
        keys[fn.name].add(key)
        return True  # skip the compile itself

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", record)
    H, HV, K, V, C, W, HQ, HKV, D, BS = 2, 4, 16, 16, 96, 4, 4, 2, 32, 16
    for N in range(1, 65):
        L = 1 + (N * 37) % 70
        T, S = N * L, N + (N % 5)  # pools of varying size
        cu = torch.arange(N + 1) * L
        read = torch.randint(0, S, (N,))
        write = torch.full((N,), -1)
        chunks = torch.stack([torch.arange(N).repeat_interleave(-(-L // 64)),
                              torch.arange(-(-L // 64)).repeat(N)], 1)
        offsets = torch.arange(N + 1) * -(-L // 64)
        x = torch.randn(T, C + 8)[:, :C]
        indexed_conv.indexed_causal_conv(x=x, weight=torch.randn(C, W), cu_seqlens=cu,
                                         conv_pool=torch.zeros(S, C, W - 1), read_slots=read, write_slots=write,
                                         chunk_indices=chunks, config=indexed_conv.CONV_CONFIGS[0])
        qk = torch.randn(T, 2, H, K)
        prep.delta_rule_inputs(qk[:, 0], qk[:, 1], DeltaGates.given(torch.randn(T, HV), torch.rand(T, HV)), cu, chunks)
        indexed_scan.indexed_scan(torch.randn(T, H, K), torch.randn(T, HV, K), torch.randn(T, HV, V),
                                  torch.randn(T, HV), cu, offsets, chunks.shape[0], torch.zeros(S, HV, K, V),
                                  read, write, config=indexed_scan.SCAN_CONFIGS[0])
        block = paged_prefix.query_block(HQ // HKV)
        nb = -(-L // block)
        attn_chunks = torch.stack([torch.arange(N).repeat_interleave(nb), torch.arange(nb).repeat(N)], 1)
        paged_prefix.paged_prefix_attention(
            q=torch.randn(T, HQ, D), k=torch.randn(T, HKV, D), v=torch.randn(T, HKV, D), cu_seqlens=cu,
            prefix_lens=torch.randint(0, 40, (N,)), key_pages=torch.zeros(S * 3, BS, HKV, D),
            value_pages=torch.zeros(S * 3, BS, HKV, D), block_table=torch.zeros(N, 4, dtype=torch.int32),
            write_slots=write, chunk_indices=attn_chunks, config=paged_prefix.ATTN_CONFIGS[0])
    assert len(keys) == len(kernels), sorted(keys)
    assert {name: len(k) for name, k in keys.items()} == {name: 1 for name in keys}
    assert triton.__version__.startswith("3.6"), "kernels are written against Triton 3.6"



def test_kernels_compile_for_hopper():
    """Every own kernel (delta rule, conv, attention, the fused norms and activations) compiles for
    sm_90 all the way to a cubin (Triton's front end, its Hopper passes and the bundled ptxas), at
    Kev-4B dims with the served dtypes: bf16 activations, fp32 states. It runs
    `python -m bench.kernel_resources --first` in a process of its own: the interpreter's patches to
    triton.language in this one would leak into the compile. The interpreter runs the maths, not
    the code generation; this catches what only a GPU compile would (a construct the Hopper backend
    rejects), with no GPU. One config each."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "bench.kernel_resources", "--first", "--json", "--pdl"], env=env,
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = {e["function"]: e for e in json.loads(out.stdout.splitlines()[-1])}
    assert set(compiled) == {"indexed_conv_fwd_kernel", "delta_rule_prep_kernel", "indexed_scan_fwd_kernel",
                             "paged_prefix_attn_fwd_kernel",
                             "paged_prefix_span_kernel", "paged_prefix_finish_kernel", "paged_store_kernel",
                             "rms_norm_fwd_kernel",
                             "gated_rms_norm_fwd_kernel", "silu_mul_fwd_kernel",
                             "sigmoid_mul_fwd_kernel"}, sorted(compiled)
    assert all(e["cubin_bytes"] > 0 and 0 < e["REG"] <= 255 for e in compiled.values())
    # launched with programmatic dependent launch (the A/B, off by default): each waits before
    # touching memory (kev/ops/pdl.py)
    assert all(e["pdl_wait_first"] for e in compiled.values()), [e["function"] for e in compiled.values()
                                                                 if not e["pdl_wait_first"]]
