"""The fused norm/activation kernels (`kev.ops.fused`) under TRITON_INTERPRET=1, and fused projections.

Each kernel against `kev.ops.fused.reference` (the maths `TorchOps` runs on CPU), on odd token
counts (T = 1, 63, 65, 129), head dims that exercise masks, inputs that are column views of one
packed buffer (as out of a fused projection), outputs poisoned with NaN. fp32 to ~1e-6; bf16 to a
bf16 ulp or so (the interpreter's bf16 casts are not the GPU's round-to-nearest: the GPU test
checks bf16 closely). Packed views give bit-identical outputs to contiguous copies.

Fused projections: parameter names, values and `state_dict` unchanged; `load_state_dict` (copy) and
`.to()` keep working; replaced parameters are refused loudly; batch invariance unfuses. The whole
model with fused projections on interpreted `TritonOps` ~= `TorchOps`, indexed == gathered.
`test_compile_count_fused_kernels` counts compile keys over T = 1..64 against a fake Hopper target.
"""

from collections import defaultdict

import pytest
import torch

from interpret_support import FakeHopper, compiled_kernels
from kev.ops.fused import reference
from kev.ops.torch_ops import TorchOps
from kernel_support import rel_err

T_CASES = (1, 63, 65, 129)
DTYPES = (torch.float32, torch.bfloat16)
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.5e-2}
EPS = 1e-6


def columns(g, T, widths, dtype, scale=1.0):
    """Column views of one [T, sum(widths) + 5] buffer (a fused projection's output), after 3 pad columns."""
    buf = (torch.randn(T, sum(widths) + 5, generator=g) * scale).to(dtype)
    out, start = [], 3
    for w in widths:
        out.append(buf[:, start:start + w])
        start += w
    return out


def check(name, ref, out, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{name}: {out.dtype} {out.shape} vs {ref.shape}"
    assert out.is_contiguous(), name
    assert torch.isfinite(out.float()).all(), f"{name}: unwritten (NaN) elements"
    err = rel_err(ref, out)
    assert err <= TOL[dtype], f"{name}: rel err {err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", T_CASES, ids=lambda t: f"T={t}")
def test_norms_match_reference(interp, poisoned, T, dtype):
    g = torch.Generator().manual_seed(T)
    H, D, R = 3, 40, 16
    w = (torch.randn(D, generator=g) * 0.3).to(dtype)
    x, h = columns(g, T, [D, D], dtype, scale=2.0)
    check("rms_norm", reference.rms_norm(x, w, EPS), interp.norms.rms_norm(x, w, EPS), dtype)

    s, y = interp.norms.add_rms_norm(x, h, w, EPS)
    ref_s, ref_y = reference.add_rms_norm(x, h, w, EPS)
    check("add_rms_norm sum", ref_s, s, dtype)
    if dtype == torch.float32:
        assert torch.equal(s, ref_s), "the residual sum is one fp32 add"
    check("add_rms_norm", ref_y, y, dtype)

    # heads: a q-like view [T, H, D] of a [T, H, 2D] projection (query and gate interleaved per head)
    (qg,) = columns(g, T, [H * 2 * D], dtype, scale=2.0)
    q = qg.unflatten(1, (H, 2 * D))[..., :D]
    check("rms_norm heads", reference.rms_norm(q, w, EPS), interp.norms.rms_norm(q, w, EPS), dtype)
    for rd in (R, D):  # partial and full rotary dims
        cos, sin = (torch.randn(T, rd, generator=g).to(dtype) for _ in range(2))
        check(f"rms_norm_rope R={rd}", reference.rms_norm_rope(q, w, EPS, cos, sin),
              interp.norms.rms_norm_rope(q, w, EPS, cos, sin), dtype)

    o = torch.randn(T, H, D, generator=g).to(dtype)
    (zbuf,) = columns(g, T, [H * D], dtype, scale=2.0)
    z = zbuf.unflatten(1, (H, D))
    check("gated_rms_norm", reference.gated_rms_norm(o, z, w, EPS), interp.norms.gated_rms_norm(o, z, w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", T_CASES, ids=lambda t: f"T={t}")
def test_activations_match_reference(interp, poisoned, T, dtype):
    g = torch.Generator().manual_seed(100 + T)
    F, H, D = 1100, 3, 40  # F crosses a column block
    gate, up = columns(g, T, [F, F], dtype, scale=3.0)
    check("silu_mul", reference.silu_mul(gate, up), interp.activations.silu_mul(gate, up), dtype)

    o = torch.randn(T, H, D, generator=g).to(dtype)
    (qg,) = columns(g, T, [H * 2 * D], dtype, scale=3.0)
    gate_h = qg.unflatten(1, (H, 2 * D))[..., D:]
    check("sigmoid_mul", reference.sigmoid_mul(o, gate_h), interp.activations.sigmoid_mul(o, gate_h), dtype)


def test_packed_views_bit_identical(interp):
    """Every fused kernel gives the same bits on packed column views as on contiguous copies."""
    g = torch.Generator().manual_seed(7)
    T, H, D, F = 70, 2, 32, 96
    w = torch.randn(D, generator=g) * 0.3
    x, h = columns(g, T, [D, D], torch.float32)
    (qg,) = columns(g, T, [H * 2 * D], torch.float32)
    q, gate = qg.unflatten(1, (H, 2 * D))[..., :D], qg.unflatten(1, (H, 2 * D))[..., D:]
    cos, sin = torch.randn(T, 8, generator=g), torch.randn(T, 8, generator=g)
    up, gp = columns(g, T, [F, F], torch.float32)
    o = torch.randn(T, H, D, generator=g)
    n, act = interp.norms, interp.activations
    c = torch.Tensor.contiguous
    pairs = [
        (n.rms_norm(x, w, EPS), n.rms_norm(c(x), w, EPS)),
        (n.add_rms_norm(x, h, w, EPS), n.add_rms_norm(c(x), c(h), w, EPS)),
        (n.rms_norm_rope(q, w, EPS, cos, sin), n.rms_norm_rope(c(q), w, EPS, cos, sin)),
        (n.gated_rms_norm(o, q, w, EPS), n.gated_rms_norm(o, c(q), w, EPS)),
        (act.silu_mul(gp, up), act.silu_mul(c(gp), c(up))),
        (act.sigmoid_mul(o, gate), act.sigmoid_mul(o, c(gate))),
    ]
    for i, (packed, copied) in enumerate(pairs):
        packed = packed if isinstance(packed, tuple) else (packed,)
        copied = copied if isinstance(copied, tuple) else (copied,)
        assert all(torch.equal(p, q) for p, q in zip(packed, copied)), f"pair {i}"


def test_outputs_written_into_a_token_slice(interp):
    """`out=` (the model's phases, each writing its own tokens of one buffer): the same bits as a
    new output, in the slice only; the reference writes the same way; a bad `out` is refused."""
    g = torch.Generator().manual_seed(8)
    T, H, D = 40, 2, 32
    o, z, gate = (torch.randn(T, H, D, generator=g) for _ in range(3))
    w = torch.randn(D, generator=g) * 0.3
    n, act = interp.norms, interp.activations
    for name, kernel, ref, args in (("gated_rms_norm", n.gated_rms_norm, reference.gated_rms_norm, (z, w, EPS)),
                                    ("sigmoid_mul", act.sigmoid_mul, reference.sigmoid_mul, (gate,))):
        rows = [a[5:25] if isinstance(a, torch.Tensor) and a.ndim == 3 else a for a in args]
        for f in (kernel, ref):
            whole = torch.full((T + 10, H, D), 7.0)
            y = f(o[5:25], *rows, out=whole[3:23])
            assert y.data_ptr() == whole[3:23].data_ptr(), name
            assert torch.equal(whole[3:23], f(o[5:25], *rows)), name
            assert (whole[:3] == 7).all() and (whole[23:] == 7).all(), f"{name} wrote outside its slice"
        with pytest.raises(ValueError, match="out"):
            kernel(o, *args, out=torch.empty(T, H, D, dtype=torch.float64))
        with pytest.raises(ValueError, match="out"):
            kernel(o, *args, out=torch.empty(T, H, 2 * D)[..., :D])  # not contiguous


def test_empty_and_bad_shapes(interp):
    n, act = interp.norms, interp.activations
    w = torch.ones(8)
    assert n.rms_norm(torch.zeros(0, 8), w, EPS).shape == (0, 8)
    assert act.silu_mul(torch.zeros(0, 8), torch.zeros(0, 8)).shape == (0, 8)
    with pytest.raises(ValueError, match=r"D=9\], got \(8,\)"):
        n.rms_norm(torch.zeros(5, 9), w, EPS)
    with pytest.raises(ValueError, match="unit stride"):
        n.rms_norm(torch.zeros(8, 5).t(), torch.ones(5), EPS)
    with pytest.raises(ValueError, match=r"\(5, 7\)"):
        act.silu_mul(torch.zeros(5, 8), torch.zeros(5, 7))


# ---- fused projections ----

def tiny_model(seed=4, dtype=torch.float32):
    from random_models import random_model, tiny_config

    return random_model(tiny_config(hv_per_h=2), seed=seed, dtype=dtype).set_batch_invariant(0)


def test_fused_projections_keep_parameters():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.fuse_projections()
    assert model.projections_fused
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    delta = model.layers[0].linear_attn
    fused = delta.fused.weight
    assert fused.shape[0] == sum(lin.out_features for lin in (delta.in_proj_qkv, delta.in_proj_z, delta.in_proj_b,
                                                               delta.in_proj_a))
    assert delta.in_proj_z.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()

    # load_state_dict copies into the views: the fused weights see the new values
    new = {k: torch.randn_like(v) for k, v in before.items()}
    model.load_state_dict(new)
    assert torch.equal(delta.fused.weight[-delta.in_proj_a.out_features:], new["layers.0.linear_attn.in_proj_a.weight"])
    mlp = model.layers[3].mlp
    assert torch.equal(mlp.fused.weight[mlp.gate_proj.out_features:], new["layers.3.mlp.up_proj.weight"])

    # .to() re-fuses on the new parameters
    model.to(torch.float64)
    assert model.projections_fused and delta.fused.weight.dtype == torch.float64
    assert delta.in_proj_qkv.weight.data_ptr() == delta.fused.weight.data_ptr()

    # replaced parameters are refused loudly, not silently served stale
    model.load_state_dict({k: v.double() for k, v in before.items()}, assign=True)
    with pytest.raises(RuntimeError, match="fuse_projections"):
        delta.fused(torch.zeros(2, model.cfg.hidden_size, dtype=torch.float64))

    # batch invariance needs one tiled GEMM per projection
    model.fuse_projections().set_batch_invariant()
    assert not model.projections_fused
    with pytest.raises(ValueError, match="batch-invariant"):
        model.fuse_projections()


@pytest.mark.slow  # ~40 s interpreted; each fused kernel is checked against its reference above, the whole model on the GPU
def test_fused_model_matches_unfused_and_reference(interp):
    """Whole model: fused projections on interpreted TritonOps (indexed == gathered bit for bit)
    ~= the unfused model on TorchOps; fused on TorchOps ~= unfused on TorchOps."""
    from kernel_support import make_pools, row_pass, state_pass

    plain, fused = tiny_model(), tiny_model().fuse_projections()
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (40, 70)]
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 17, 65)]
    read = torch.tensor([0, 7, 2, 7, 0, 7])[::2]  # slots 0, 2, 0 through a strided view
    doc_lens = torch.tensor([70, 0, 40, 0])
    outs, banks = {}, {}
    for name, model, ops in (("plain-torch", plain, TorchOps()), ("fused-torch", fused, TorchOps()),
                             ("fused-indexed", fused, interp.triton_ops.TritonOps()),
                             ("fused-gathered", fused, interp.gathered_ops.GatheredOps())):
        pools, table = make_pools(model.cfg, 4, 160, 16, torch.float32, "cpu", strided=True)
        state_pass(model, ops, pools, table, docs, [2, 0], chunk=64)
        outs[name] = row_pass(model, ops, pools, table, rows, read, doc_lens)
        banks[name] = pools
    assert torch.equal(outs["fused-indexed"], outs["fused-gathered"])
    assert rel_err(outs["plain-torch"], outs["fused-torch"]) <= 1e-5
    assert rel_err(outs["plain-torch"], outs["fused-indexed"]) <= 2e-3
    for a, b in zip(banks["plain-torch"].tensors(), banks["fused-indexed"].tensors()):
        assert rel_err(a, b) <= 2e-3


# ---- compile count: the real JIT front end, a fake Hopper target, nothing compiled ----

@pytest.fixture
def compiled_modules():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check (the GPU test counts real compiles)")
    with compiled_kernels() as mods:
        yield mods


def test_compile_count_fused_kernels(compiled_modules, monkeypatch):
    """The token count (1..64) changes no compile key of any fused kernel."""
    from triton import knobs
    from triton.runtime.driver import driver

    n, act = compiled_modules.norms, compiled_modules.activations
    kernels = [n.rms_norm_fwd_kernel, n.gated_rms_norm_fwd_kernel, act.silu_mul_fwd_kernel,
               act.sigmoid_mul_fwd_kernel]
    for kern in kernels:
        monkeypatch.setattr(kern, "device_caches", defaultdict(kern.create_binder))
    monkeypatch.setattr(driver, "_active", FakeHopper())
    keys = defaultdict(set)

    def record(*, key, fn, **_):
        keys[fn.name].add(key)
        return True  # skip the compile itself

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", record)
    d, H, D, F = 64, 4, 32, 96
    w = torch.randn(D)
    for T in range(1, 65):
        hidden = torch.randn(T, d + 16)[:, :d]  # a column view: fixed row stride
        n.rms_norm(hidden, torch.randn(d), EPS)
        n.add_rms_norm(hidden, hidden, torch.randn(d), EPS)
        qg = torch.randn(T, H, 2 * D)
        n.rms_norm_rope(qg[..., :D], w, EPS, torch.randn(T, 8), torch.randn(T, 8))
        n.gated_rms_norm(torch.randn(T, H, D), qg[..., D:], w, EPS)
        gu = torch.randn(T, 2 * F)
        act.silu_mul(gu[:, :F], gu[:, F:])
        act.sigmoid_mul(torch.randn(T, H, D), qg[..., D:])
    counts = {name: len(k) for name, k in keys.items()}
    # rms_norm_fwd_kernel: plain, residual and RoPE variants (constexpr flags); one key each
    assert counts == {"rms_norm_fwd_kernel": 3, "gated_rms_norm_fwd_kernel": 1, "silu_mul_fwd_kernel": 1,
                      "sigmoid_mul_fwd_kernel": 1}, counts
