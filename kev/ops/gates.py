"""`DeltaGates`: a pass's DeltaNet gates as the delta rule takes them.

The model hands the delta rule the layer's raw gate inputs, the a and b projections ([T, HV]
column views of its fused input projection) and its A_log, dt_bias ([HV]), not the gates
themselves: the GPU forms g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) inside the
delta rule's first kernel, with the chunk-local cumsum of g and the L2 norm of q and k
(`kev.ops.delta_rule.prep`), one launch where there were three. The reference forms them with
`values()`. Tests that choose the log decay and beta directly use `given(g, beta)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kev.ops.fused import reference


@dataclass(frozen=True, eq=False)
class DeltaGates:
    a: torch.Tensor | None = None  # [T, HV] in_proj_a output (may be a column view)
    b: torch.Tensor | None = None  # [T, HV] in_proj_b output (may be a column view)
    A_log: torch.Tensor | None = None  # [HV]
    dt_bias: torch.Tensor | None = None  # [HV]
    g: torch.Tensor | None = None  # given: [T, HV] fp32 log decay (natural log, per token)
    beta: torch.Tensor | None = None  # given: [T, HV]

    def __post_init__(self) -> None:
        raw = [t is not None for t in (self.a, self.b, self.A_log, self.dt_bias)]
        given = [t is not None for t in (self.g, self.beta)]
        if not ((all(raw) and not any(given)) or (all(given) and not any(raw))):
            raise ValueError("DeltaGates takes a, b, A_log and dt_bias, or g and beta (given)")

    @classmethod
    def given(cls, g: torch.Tensor, beta: torch.Tensor) -> "DeltaGates":
        return cls(g=g, beta=beta)

    @property
    def raw(self) -> bool:
        """Whether the gates are still to be formed from the projections."""
        return self.g is None

    @property
    def shape(self) -> torch.Size:
        """[T, HV]."""
        return self.a.shape if self.raw else self.g.shape

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, HV] fp32 log decay, beta [T, HV]): the reference maths, or the given tensors."""
        if self.raw:
            return reference.delta_gates(self.a, self.b, self.A_log, self.dt_bias)
        return self.g, self.beta
