"""Which `scan_output` configs fault, on which sequences: each (case, mode) in fresh processes.

The delta rule's output inside its state kernel (`kev.ops.delta_rule.scan_output`, off by default)
hit an illegal memory access on its first GPU runs (H200 and H100, 62a61df / 5fa43b6): while the
autotuner benchmarked its configs on rows of 1/17/64/129 tokens reading bank slots; rows of at most
64 tokens passed. Those faults were with programmatic dependent launch on (kev/ops/pdl.py, then the
default) and without CUDA_LAUNCH_BLOCKING. Every case runs every config in three modes: as served
(`no-pdl`: plain stream order), with PDL (`pdl`), and with PDL and serialised launches
(`pdl-blocking`: CUDA_LAUNCH_BLOCKING=1, the fault reported at the launch that made it, no two
kernels overlapping; under compute-sanitizer's memcheck when it is on PATH and `--sanitizer` is
given: the faulting access's address and thread). A fault in `pdl` alone points at the launch
order, one in every mode at the kernel. A fault ends every later CUDA call of its process, so a
(case, mode) runs its configs in a process that reports each as it ends; after a fault the next
config starts a new one. A config that does not fault is compared with the split path (the
indexed scan, then fla's chunk_fwd_o) on the same inputs: the same bits are not promised across
the two paths, so the relative error is reported.

At 5ea7209 (the keys no longer one tile in both dot roles) the case that had faulted ran clean
with PDL (all 8 configs) and without (the 3 reached), each bit for bit the split path's (H100,
`bench/results/scan_output_faults.json`).

    python -m bench.scan_output_faults --out $OUT/scan_output_faults.json [--sanitizer]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

# (name, per-sequence lengths, reads a bank slot, writes its final state)
CASES = {
    "rows-1-17-64-129": ([1, 17, 64, 129] * 2, True, False),  # the failing GPU test's pass (8 rows)
    "row-129": ([129], True, False),
    "row-65": ([65], True, False),
    "rows-64": ([64] * 8, True, False),
    "doc-129-writes": ([129], False, True),
    "row-129-writes": ([129], True, True),
}
# mode -> (PDL on, CUDA_LAUNCH_BLOCKING); the served mode first: a call cut short has it
MODES = {"no-pdl": (False, False), "pdl": (True, False), "pdl-blocking": (True, True)}


def configs_from(case: str, start: int, pdl_on: bool):
    """Runs case `case` with each config of SCAN_OUTPUT_CONFIGS from `start` on (in this
    process), yielding (index, result) as each ends."""
    from bench.common import kev4b_config
    from kev.ops import pdl
    from kev.ops.delta_rule import scan_output
    from kev.ops.delta_rule.indexed_scan import indexed_chunk_gated_delta_rule
    from kev.ops.gates import DeltaGates

    pdl.on = pdl_on
    lens, reads, writes = CASES[case]
    cfg = kev4b_config()
    H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = dict(device="cuda", generator=gen)
    T, N, S = sum(lens), len(lens), 16
    qkv = torch.randn(T, 2 * H * K + HV * V, **dev).bfloat16()
    q, k = qkv[:, :H * K].unflatten(1, (H, K)), qkv[:, H * K:2 * H * K].unflatten(1, (H, K))
    v = qkv[:, 2 * H * K:].unflatten(1, (HV, V))
    gates = DeltaGates.given(-torch.rand(T, HV, **dev) * 0.2, torch.rand(T, HV, **dev).bfloat16())
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    read = torch.arange(N, device="cuda") % S if reads else torch.full((N,), -1, device="cuda")
    write = (torch.arange(N, device="cuda") + 3) % S if writes else torch.full((N,), -1, device="cuda")
    pool = torch.randn(S, HV, K, V, **dev) * 0.05

    def run(output_in_scan: bool, config=None):
        p = pool.clone()
        o = indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=cu, state_pool=p, read_slots=read,
                                           write_slots=write, output_in_scan=output_in_scan, scan_config=config)
        torch.cuda.synchronize()
        return o, p

    def err(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()

    split_o, split_pool = run(False)
    for index in range(start, len(scan_output.SCAN_OUTPUT_CONFIGS)):
        fused_o, fused_pool = run(True, scan_output.SCAN_OUTPUT_CONFIGS[index])
        yield index, {"o_rel_err": err(fused_o, split_o), "pool_rel_err": err(fused_pool, split_pool),
                      "finite": bool(torch.isfinite(fused_o.float()).all()), "pdl": pdl.enabled()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sanitizer", action="store_true", help="the blocking mode under compute-sanitizer when on PATH")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a process")
    ap.add_argument("--one", nargs=3, metavar=("CASE", "MODE", "START"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        case, mode, start = args.one
        for index, result in configs_from(case, int(start), MODES[mode][0]):
            print(f"RESULT {index} " + json.dumps(result), flush=True)
        return

    from kev.ops.delta_rule.scan_output import SCAN_OUTPUT_CONFIGS

    sanitizer = shutil.which("compute-sanitizer") if args.sanitizer else None
    device = torch.cuda.get_device_name()
    results = {}

    def record(case, mode, index, entry):
        results[f"{case} / {SCAN_OUTPUT_CONFIGS[index]} / {mode}"] = entry
        print(case, SCAN_OUTPUT_CONFIGS[index], mode, "FAULT" if entry.get("fault") else entry, flush=True)
        with open(args.out, "w") as f:  # after every config: a call cut short keeps what it found
            json.dump({"commit": os.environ.get("KEV_COMMIT"), "device": device, "sanitizer": sanitizer,
                       "modes": MODES, "results": results}, f, indent=1)

    for mode, (_, blocking) in MODES.items():
        env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1" if blocking else "0"}
        for case in CASES:
            start = 0
            while start < len(SCAN_OUTPUT_CONFIGS):
                cmd = [sys.executable, "-m", "bench.scan_output_faults", "--out", "-", "--one", case, mode, str(start)]
                if sanitizer and blocking:  # memcheck serialises launches anyway
                    cmd = [sanitizer, "--tool", "memcheck", "--print-limit", "3", *cmd]
                try:
                    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                    out, rc = done.stdout + "\n" + done.stderr, done.returncode
                except subprocess.TimeoutExpired as e:
                    got = e.stdout or b""
                    out, rc = got if isinstance(got, str) else got.decode(errors="replace"), None
                for line in out.splitlines():
                    if line.startswith("RESULT "):
                        index, result = line[7:].split(" ", 1)
                        record(case, mode, int(index), json.loads(result))
                        start = int(index) + 1
                if rc == 0:
                    break
                if start < len(SCAN_OUTPUT_CONFIGS):  # the config after the last reported one ended the process
                    record(case, mode, start, {"fault": True if rc is not None else None, "rc": rc,
                                               "tail": out[-1500:]})
                    start += 1


if __name__ == "__main__":
    main()
