"""How much device memory a process needs: a state pass's bound above the weights and the bank
(`state_pass_peak_bytes`, which the bank's pass-size cap is checked against), any pass's
(`pass_peak_bytes`), and the start-up memory plan of a whole process (`memory_plan`: weights + bank
+ pass workspace + CUDA-graph pool + context), checked against the device (`check_memory_plan`)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kev.exec.graphs import KeyLadder, token_ladder
from kev.exec.plan import GraphPlan, PassRole
from kev.exec.static_pass import CHUNK, PassKind
from kev.model.config import ModelConfig
from kev.model.qwen35 import Qwen35Model
from kev.ops.attention.paged_prefix import PREFIX_SPANS
from kev.ops.shapes import CLASS_SHAPES, classify

log = logging.getLogger(__name__)

# Safety factor of `state_pass_peak_bytes` over its itemised estimate: kernel temporaries not listed,
# allocation rounding, tensors freed a little later than the listing assumes.
PEAK_SLACK = 1.5


def state_pass_peak_bytes(cfg: ModelConfig, tokens: int, sequences: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bound on the device memory one state pass of `tokens` packed tokens (`sequences` documents)
    allocates above the weights and the bank (the runner's own chunking makes this the whole story
    for any document length: a long document runs `state_chunk_tokens` at a time, its state riding
    in its slot, so nothing grows with the document).

    Itemised per token (activation dtype e bytes, fp32 4 bytes), the largest of the three layer
    kinds while it runs, plus the residual stream around it:
    - residual stream: x, its norm and the previous block's output: 3 d e
    - DeltaNet: the fused projection output (conv_dim + value_dim + 2 HV) e, the conv output
      conv_dim e, g (fp32) and beta, l2-normalised q and k 2 H K e, v made contiguous, fla's
      chunk-local cumsum (fp32), WY w, u and A (HV K + HV V + HV 64) e, v_new, o (HV V e each);
      plus the state at every chunk start, HV K V e per 64-token chunk
    - attention: the fused q/gate, k, v output (2 Hq D + 2 Hkv D) e, q and k after norm/RoPE,
      o and the gated o
    - MLP: gate/up 2 F e, silu(gate) * up F e, the down projection d e
    - positions, token ids, RoPE tables
    times `PEAK_SLACK`. Kev-4B at 8,192 tokens: ~126 KB per token, the DeltaNet layer, 1.55 GB bound."""
    e = torch.empty((), dtype=dtype).element_size()
    d, F = cfg.hidden_size, cfg.intermediate_size
    H, K = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    HV, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    chunk = CHUNK  # the delta rule's chunk (kev.ops.delta_rule.indexed_scan.CHUNK)
    residual = 3 * d * e
    deltanet = ((cfg.conv_dim + cfg.linear_value_dim + 2 * HV) * e + cfg.conv_dim * e + HV * (4 + e)
                + 2 * H * K * e + HV * V * e + HV * 4 + (HV * K + HV * V + HV * chunk) * e + 2 * HV * V * e)
    attention = (2 * Hq * D + 2 * Hkv * D) * e + (Hq * D + Hkv * D) * e + 2 * Hq * D * e
    mlp = 3 * F * e + d * e
    index = 2 * 8 + cfg.rotary_dim * (2 * e + 12)
    per_token = residual + max(deltanet, attention, mlp) + index
    chunk_states = (tokens // chunk + sequences) * HV * K * V * e if cfg.deltanet_layers else 0
    return int(PEAK_SLACK * (tokens * per_token + chunk_states))


# ---------------------------------------------------------------------------------------------
# The start-up memory plan: weights + bank + workspaces + CUDA graphs against the device's memory.

GB = 10**9
# Device memory a CUDA process takes beyond the tensors listed: its CUDA context (~0.5 GB with
# torch's lazy module loading), cuBLAS workspaces, the loaded Triton kernels, the decision head and
# allocator rounding. An allowance, not a measurement.
PROCESS_OVERHEAD_BYTES = 1 * GB
SPLIT_PASS_TOKENS = 256  # passes up to this many tokens may run attention's split mode (rows_few)


class MemoryPlanError(ValueError):
    """A process's memory plan does not fit its device (the message names every part, in GB)."""


def pass_peak_bytes(cfg: ModelConfig, tokens: int, sequences: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bound on what one pass (state or row) of `tokens` packed tokens in `sequences` sequences
    allocates above the weights and the bank: `state_pass_peak_bytes` (a row pass computes the same
    activations per token and writes nothing), plus, for passes of at most SPLIT_PASS_TOKENS tokens,
    attention's split-mode workspace (PREFIX_SPANS fp32 partial outputs and their max / sum per
    query head and token)."""
    bound = state_pass_peak_bytes(cfg, tokens, sequences, dtype)
    if tokens <= SPLIT_PASS_TOKENS and cfg.attention_layers:
        Hq, D = cfg.num_attention_heads, cfg.head_dim
        bound += int(PEAK_SLACK * PREFIX_SPANS * tokens * Hq * (D + 2) * 4)
    return bound


@functools.lru_cache(maxsize=16)
def weight_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the backbone's weights as served: every parameter of `Qwen35Model(cfg)` (embedding
    once, no LM head: serving never loads one; fused projections are views, no second copy)."""
    with torch.device("meta"):
        model = Qwen35Model(cfg)
    e = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * e


@dataclass(frozen=True)
class MemoryPlan:
    """What one process (or, added up, a pod) holds on its device, part by part, in bytes."""

    who: str
    parts: tuple[tuple[str, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.parts)

    def part(self, name: str) -> int:
        return sum(n for p, n in self.parts if p == name)

    def __add__(self, other: "MemoryPlan") -> "MemoryPlan":
        return MemoryPlan(f"{self.who} + {other.who}",
                          tuple((f"{self.who} {p}", n) for p, n in self.parts)
                          + tuple((f"{other.who} {p}", n) for p, n in other.parts))

    def describe(self) -> str:
        return " + ".join(f"{p} {n / GB:.2f} GB" for p, n in self.parts if n) + f" = {self.total_bytes / GB:.2f} GB"

    def fits(self, device_bytes: int) -> bool:
        return self.total_bytes <= device_bytes

    def check(self, device_bytes: int, device: str = "the device") -> None:
        """Raises MemoryPlanError naming every part, the total and the device's memory if the plan
        does not fit `device_bytes`."""
        if not self.fits(device_bytes):
            raise MemoryPlanError(
                f"the {self.who}'s memory plan does not fit {device}: {self.describe()}, but {device} has "
                f"{device_bytes / GB:.2f} GB for it (short by {(self.total_bytes - device_bytes) / GB:.2f} GB). "
                "Lower KEV_BANK_MEMORY_BYTES (bank) or the pass caps (bank: --max-pass-tokens, "
                "--max-pass-documents; scorer: KEV_MAX_TOKENS_PER_PASS, KEV_MAX_ROWS_PER_PASS), turn "
                "KEV_CUDA_GRAPHS off, keep KEV_SHARE_WEIGHTS on (one copy of the weights per GPU), or use a "
                "larger GPU (deploy/README.md, \"Memory plan per model\")")


def _largest_pass(cfg: ModelConfig, passes: list[tuple[int, int]], dtype: torch.dtype) -> int:
    return max((pass_peak_bytes(cfg, t, s, dtype) for t, s in passes if t > 0), default=0)


def memory_plan(cfg: ModelConfig, role: PassRole, graphs: GraphPlan | None = None, *, bank_bytes: int = 0,
                weights_shared: bool = False, dtype: torch.dtype = torch.bfloat16, state_chunk_tokens: int = 8192,
                max_doc_tokens: int = 65536, block_size: int = 64, who: str | None = None) -> MemoryPlan:
    """The device memory of one serving process, part by part: the one place the arithmetic lives
    (the bank and the scorer check it at start-up, `bench/memory_budget.py` prints the deployment
    table from it, tests/exec/test_memory_plan.py checks it for every Kev size).

    - weights: `weight_bytes` (none when `weights_shared`: a scorer mapping the bank's copy);
    - bank: `bank_bytes` (KEV_BANK_MEMORY_BYTES; the bank process's own pools);
    - pass workspace: the largest pass the process runs outside a graph (`pass_peak_bytes`): its
      pass caps (`graphs`: a state pass of `max(state_tokens, state_chunk_tokens)` tokens, one long
      document's chunk running alone; a row pass of `row_tokens`), and the start-up warm-up's class
      shapes (`kev.ops.shapes.CLASS_SHAPES`) of the classes it warms;
    - CUDA-graph pool (`graphs.cuda_graphs`): the largest key's activations, once (every graph
      shares one pool, captured largest first), with its chunk-list entries C counted as chunks;
      plus every key's static index buffers and block-table rows, and the rows' shared output buffer;
    - PROCESS_OVERHEAD_BYTES: CUDA context, cuBLAS workspaces, kernels.
    The pass workspace and the graph pool are counted both: a key's warm-up runs eagerly just
    before its capture (the allocator cannot free those cached blocks while a capture is under
    way), and passes beyond the caps always run eagerly. Every pass term is `PEAK_SLACK` over its
    itemised activations (measured on the H200: ~0.66 of the bound, bench/results/state_pass.json),
    so the plan is a bound, not a forecast."""
    graphs = graphs if graphs is not None else GraphPlan()
    ladders = []
    eager: list[tuple[int, int]] = []
    if role.states:
        ladders.append(KeyLadder(PassKind.STATE, graphs.state_tokens, graphs.state_seqs))
        eager.append((max(graphs.state_tokens, state_chunk_tokens), graphs.state_seqs))
    if role.rows:
        ladders.append(KeyLadder(PassKind.ROWS, graphs.row_tokens, graphs.row_seqs))
        eager.append((graphs.row_tokens, graphs.row_seqs))
    if role.states and role.rows and graphs.sweep_one_document:  # the bank's idle sweeps: one document, its rows
        eager.append((state_chunk_tokens + graphs.row_tokens, 1 + graphs.row_seqs))
    elif role.states and role.rows:  # the engine's sweeps: a state key and a row key in one pass
        eager.append((max(graphs.state_tokens, state_chunk_tokens) + graphs.row_tokens,
                      graphs.state_seqs + graphs.row_seqs))
    classes = set(graphs.warm) if graphs.warm is not None else {
        classify(T, rows=ladder.kind is PassKind.ROWS) for ladder in ladders for T in token_ladder(ladder.max_tokens)}
    eager += [(s.seqs * s.tokens, s.seqs) for c in classes for s in CLASS_SHAPES[c]]

    parts = [("weights", 0 if weights_shared else weight_bytes(cfg, dtype))]
    if bank_bytes:
        parts.append(("bank", bank_bytes))
    parts.append(("pass workspace", _largest_pass(cfg, eager, dtype)))
    if graphs.cuda_graphs:
        keys = [k for ladder in ladders for k in ladder.keys()]
        pool = max(pass_peak_bytes(cfg, k.tokens, max(1, k.chunks - k.tokens // CHUNK), dtype) for k in keys)
        table_width = -(-max_doc_tokens // block_size)
        # per key: int64 tokens, positions, picks, cu_seqlens, slots, prefix lengths, chunk lists
        # (attention's at 16-token query blocks at most), and int32 block-table rows
        statics = sum(8 * (2 * k.tokens + k.picks + 5 * (k.chunks + 1) + 2 * k.chunks + 8 * k.chunks)
                      + 4 * k.chunks * table_width for k in keys)
        out = graphs.row_tokens * cfg.hidden_size * torch.empty((), dtype=dtype).element_size() if role.rows else 0
        parts.append(("CUDA-graph pool", pool + statics + out))
    parts.append(("CUDA context and kernels", PROCESS_OVERHEAD_BYTES))
    who = who or {"states": "bank", "rows": "scorer", "both": "engine"}[role.value]
    return MemoryPlan(who, tuple(parts))


def device_memory_bytes(device: torch.device | str) -> int | None:
    """What a process may plan on `device` now: its free memory plus what this process's allocator
    already holds (weights loaded before the check count in the plan); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def check_memory_plan(plan: MemoryPlan, device: torch.device | str) -> MemoryPlan:
    """The start-up check: raises MemoryPlanError when `plan` does not fit `device`'s memory now
    (`device_memory_bytes`); on CPU it checks nothing. Logs the plan either way; returns it."""
    have = device_memory_bytes(device)
    if have is None:
        log.info("memory plan of the %s on %s (not checked off CUDA): %s", plan.who, device, plan.describe())
        return plan
    plan.check(have, str(device))
    log.info("memory plan of the %s fits %s: %s of %.2f GB", plan.who, device, plan.describe(), have / GB)
    return plan
