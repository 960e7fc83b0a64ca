"""The whole-pod memory budget of every Kev size on an H100 80GB and an H200 141GB, from the
services' own start-up plan (`kev.exec.memory.memory_plan`) at their default settings: the table in
deploy/README.md ("Memory plan per model") and the bank sizes of the H100 overlays
(deploy/components/h100 for Kev-4B, deploy/components/models/ for the others); with `--family`,
docs/models.md's table of the Kev sizes. tests/deploy/test_model_overlays.py checks that all of
them match this.

A pod is one bank process (the weights, once; the bank; its state-pass workspace and graph pool;
a CUDA context) and one scorer process that maps the bank's weights (its row-pass workspace and
graph pool; a CUDA context). The bank is what is left of the device after everything else and
HEADROOM_BYTES, in whole GiB.

    python -m bench.memory_budget            # deploy/README.md's table
    python -m bench.memory_budget --family   # docs/models.md's
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from bench.common import KEV_MODELS, kev_config
from kev.exec.memory import GB, MemoryPlan, memory_plan, weight_bytes
from kev.exec.plan import GraphPlan, PassRole
from kev.model.config import ModelConfig

GIB = 1 << 30
# What CUDA lets a process use (torch.cuda.get_device_properties().total_memory, about: the card's
# 80 GiB / 141 GB less what the driver keeps), in bytes.
DEVICES = {"H100 80GB": 85_000_000_000, "H200 141GB": 150_000_000_000}
HEADROOM_BYTES = 2 * GB  # left free on the device beyond the plan (the plan itself is a bound)
# The bank's default plan (bank_service/config.py): its state-pass caps and its idle sweeps' row caps
# (tests/exec/test_memory_plan.py checks they are the service's defaults).
BANK_ROLE = PassRole.BOTH
BANK_GRAPHS = GraphPlan(row_tokens=2048, row_seqs=32, sweep_one_document=True)


@dataclass(frozen=True)
class PodBudget:
    model: str
    device: str
    device_bytes: int
    bank_bytes: int  # KEV_BANK_MEMORY_BYTES: whole GiB
    pod: MemoryPlan  # bank process + scorer process, at that bank size

    @property
    def fits(self) -> bool:
        return self.bank_bytes > 0 and self.pod.total_bytes + HEADROOM_BYTES <= self.device_bytes


def pod_plan(cfg: ModelConfig, bank_bytes: int, *, weights_shared: bool = True,
             bank_graphs: GraphPlan = BANK_GRAPHS, scorer_graphs: GraphPlan = GraphPlan()) -> MemoryPlan:
    """One bank process and one scorer (mapping the bank's weights unless `weights_shared` is False)."""
    bank = memory_plan(cfg, BANK_ROLE, bank_graphs, bank_bytes=bank_bytes, dtype=torch.bfloat16, who="bank")
    scorer = memory_plan(cfg, PassRole.ROWS, scorer_graphs, weights_shared=weights_shared, dtype=torch.bfloat16)
    return bank + scorer


def largest_bank(cfg: ModelConfig, device_bytes: int, *, weights_shared: bool = True) -> int:
    """The largest whole-GiB bank whose pod fits `device_bytes` with HEADROOM_BYTES to spare (0: none)."""
    rest = pod_plan(cfg, 0, weights_shared=weights_shared).total_bytes
    return max(0, (device_bytes - HEADROOM_BYTES - rest) // GIB * GIB)


def budget(model: str, device: str, *, weights_shared: bool = True) -> PodBudget:
    cfg, device_bytes = kev_config(model), DEVICES[device]
    bank = largest_bank(cfg, device_bytes, weights_shared=weights_shared)
    return PodBudget(model, device, device_bytes, bank, pod_plan(cfg, bank, weights_shared=weights_shared))


def _gb(n: int) -> str:
    return f"{n / GB:.1f}"


def table() -> str:
    """deploy/README.md's table: per model, the pod's parts (GB) and the bank each GPU leaves."""
    head = ("| model | weights, once | bank process: state-pass workspace + graph pool | scorer: row-pass workspace "
            "+ graph pool | CUDA contexts (2) | pod without the bank | " + " | ".join(
                f"{d}: bank (`KEV_BANK_MEMORY_BYTES`), pod total" for d in DEVICES)
            + " | H100 bank if the scorer loads its own weights |")
    lines = [head, "|" + "---|" * (7 + len(DEVICES))]
    for model in KEV_MODELS:
        cfg = kev_config(model)
        empty = pod_plan(cfg, 0)
        cells = [f"Kev-{model.removeprefix('kev-').upper()}", _gb(empty.part("bank weights")),
                 _gb(empty.part("bank pass workspace") + empty.part("bank CUDA-graph pool")),
                 _gb(empty.part("scorer pass workspace") + empty.part("scorer CUDA-graph pool")),
                 _gb(empty.part("bank CUDA context and kernels") + empty.part("scorer CUDA context and kernels")),
                 _gb(empty.total_bytes)]
        for device in DEVICES:
            b = budget(model, device)
            cells.append(f"{b.bank_bytes // GIB} GiB (`{b.bank_bytes}`), {_gb(b.pod.total_bytes)} GB"
                         if b.fits else "does not fit")
        own = budget(model, "H100 80GB", weights_shared=False)
        cells.append(f"{own.bank_bytes // GIB} GiB" if own.fits else "does not fit")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def family_table() -> str:
    """docs/models.md's table: each Kev size's shape, parameters (`ModelConfig.non_embedding_params`
    and the embedding) and the bf16 weights a process serves (`kev.exec.memory.weight_bytes`: no LM
    head)."""
    lines = ["| model | layers (DeltaNet / attention) | hidden | MLP | attention q / kv heads | DeltaNet key / value "
             "heads (ratio) | tied embeddings | non-embedding parameters | embedding | bf16 weights served |",
             "|" + "---|" * 10]
    for model in KEV_MODELS:
        cfg = kev_config(model)
        H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        lines.append(" | ".join([
            f"| Kev-{model.removeprefix('kev-').upper()}",
            f"{cfg.num_layers} ({len(cfg.deltanet_layers)} / {len(cfg.attention_layers)})",
            f"{cfg.hidden_size:,}", f"{cfg.intermediate_size:,}",
            f"{cfg.num_attention_heads} / {cfg.num_key_value_heads}", f"{H} / {HV} ({HV // H})",
            "yes" if cfg.tie_word_embeddings else "no", f"{cfg.non_embedding_params() / 1e9:.2f} B",
            f"{cfg.vocab_size * cfg.hidden_size / 1e9:.2f} B", f"{weight_bytes(cfg) / GB:.1f} GB |"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_budget", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", action="store_true", help="docs/models.md's table of the Kev sizes instead")
    args = p.parse_args(argv)
    print(family_table() if args.family else table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
