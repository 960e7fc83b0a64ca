"""Programmatic dependent launch (kev/ops/pdl.py): every kernel of ours waits before it touches
memory, every launch of ours sets the wait and the launch attribute together, and PDL is on only
where it exists. (That the compiled Hopper code waits before its first global memory access is
checked on every kernel by test_kernels_compile_for_hopper.)"""

from __future__ import annotations

import ast
from pathlib import Path

from interpret_support import FakeHopper
from kev.ops import pdl

OPS = Path(__file__).resolve().parents[2] / "kev" / "ops"


def _jit_kernels(tree: ast.Module) -> list[ast.FunctionDef]:
    """Top-level functions decorated with triton.jit that are launched (a grid): names *_kernel."""
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
            and any("jit" in ast.unparse(d) for d in node.decorator_list)]


def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(OPS.rglob("*.py"))}


def test_every_kernel_waits_first():
    kernels = 0
    for path, tree in _sources().items():
        for fn in _jit_kernels(tree):
            kernels += 1
            args = [a.arg for a in fn.args.args]
            assert args[-1] == "USE_PDL", f"{path.name}:{fn.name} takes no USE_PDL last"
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body  # after the docstring
            assert ast.unparse(body[0]) == "wait_for_previous(USE_PDL)", f"{path.name}:{fn.name} reads before waiting"
    assert kernels >= 11  # the own kernels: a file that stops being found fails here


def test_every_launch_passes_the_launch_options():
    """A launch `kernel[grid](...)` in kev/ops always spreads `launch_options()`: USE_PDL and
    launch_pdl come together, never the attribute on a kernel that does not wait."""
    launches = 0
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                launches += 1
                spread = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
                assert "launch_options()" in spread, f"{path.name}:{node.lineno} launches without launch_options()"
                assert not any(k.arg in ("launch_pdl", "USE_PDL") for k in node.keywords), f"{path.name}:{node.lineno}"
    assert launches >= 12


def test_pdl_only_where_it_exists(monkeypatch):
    from triton.runtime.driver import driver

    monkeypatch.setattr(driver, "_active", FakeHopper())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.launch_options() == {"USE_PDL": False}  # off by default
    monkeypatch.setattr(pdl, "on", True)
    assert pdl.launch_options() == {"USE_PDL": True, "launch_pdl": True}  # sm_90, switched on (A/B runs)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_options() == {"USE_PDL": False}  # the interpreter runs no PTX
    monkeypatch.delenv("TRITON_INTERPRET")

    class Ampere(FakeHopper):
        def get_current_target(self):
            target = super().get_current_target()
            return type(target)(target.backend, 80, target.warp_size)

    monkeypatch.setattr(driver, "_active", Ampere())
    assert pdl.launch_options() == {"USE_PDL": False}  # no griddepcontrol below sm_90


def test_the_wait_is_a_no_op_when_off():
    """Off, the helper is empty: the interpreter (which runs no inline PTX) runs a kernel with it."""
    import torch
    import triton
    import triton.language as tl

    from interpret_support import interpreted_kernels

    def copy_kernel(x, y, USE_PDL: tl.constexpr = False):
        pdl.wait_for_previous(USE_PDL)
        tl.store(y + tl.arange(0, 4), tl.load(x + tl.arange(0, 4)))

    with interpreted_kernels():
        x, y = torch.arange(4.0), torch.zeros(4)
        triton.jit(copy_kernel)[(1,)](x, y, **pdl.launch_options())
        assert torch.equal(x, y)
