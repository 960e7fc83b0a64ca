"""Which `scan_output` configs fault, on which sequences: one fresh process per (case, config, mode).

The delta rule's output inside its state kernel (`kev.ops.delta_rule.scan_output`, off by default)
hit an illegal memory access on its first GPU runs (H200 and H100, 62a61df / 5fa43b6): while the
autotuner benchmarked its configs on rows of 1/17/64/129 tokens reading bank slots; rows of at most
64 tokens passed. Those faults were with programmatic dependent launch on (kev/ops/pdl.py, then the
default) and without CUDA_LAUNCH_BLOCKING, so the first case runs every config in three modes:
with PDL (`pdl`), in plain stream order (`no-pdl`, as served now) and with PDL and serialised
launches (`pdl-blocking`: CUDA_LAUNCH_BLOCKING=1, the fault reported at the launch that made it,
and no two kernels overlap). A fault in `pdl` alone points at the launch order, one in every mode
at the kernel. The other cases run in `pdl-blocking`. At 5ea7209 (the keys no longer one tile in
both dot roles) the first case ran clean in `pdl` and `no-pdl`, every config bit for bit the split
path's (H100, `bench/results/scan_output_faults.json`). A fault ends every
later CUDA call of its process, so each run is a process of its own; where `compute-sanitizer` is on
PATH and `--sanitizer` is given, the blocking mode's runs are under its memcheck (the faulting
access's address and thread). A run that does not fault is compared with the split path (the
indexed scan, then fla's chunk_fwd_o) on the same inputs: the same bits are not promised across
the two paths, so the relative error is reported.

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
# mode -> (PDL on, CUDA_LAUNCH_BLOCKING)
MODES = {"pdl": (True, False), "pdl-blocking": (True, True), "no-pdl": (False, False)}
FIRST_CASE_MODES, OTHER_CASES_MODES = ("pdl", "no-pdl", "pdl-blocking"), ("pdl-blocking",)


def one(case: str, index: int, pdl_on: bool) -> dict:
    """Runs case `case` with config `index` of SCAN_OUTPUT_CONFIGS (in this process); its result."""
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

    config = scan_output.SCAN_OUTPUT_CONFIGS[index]
    fused_o, fused_pool = run(True, config)
    split_o, split_pool = run(False)
    err = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()  # noqa: E731
    return {"o_rel_err": err(fused_o, split_o), "pool_rel_err": err(fused_pool, split_pool),
            "finite": bool(torch.isfinite(fused_o.float()).all()), "pdl": pdl.enabled()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sanitizer", action="store_true", help="run each case under compute-sanitizer when on PATH")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per (case, config) process")
    ap.add_argument("--one", nargs=3, metavar=("CASE", "CONFIG", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]), MODES[args.one[2]][0])), flush=True)
        return

    from kev.ops.delta_rule.scan_output import SCAN_OUTPUT_CONFIGS

    sanitizer = shutil.which("compute-sanitizer") if args.sanitizer else None
    device = torch.cuda.get_device_name()
    first = next(iter(CASES))
    runs = [(case, i, mode) for case in CASES for mode in (FIRST_CASE_MODES if case == first else OTHER_CASES_MODES)
            for i in range(len(SCAN_OUTPUT_CONFIGS))]  # the fast modes first: a call cut short has them
    results = {}
    for case, i, mode in runs:
        config = SCAN_OUTPUT_CONFIGS[i]
        env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1" if MODES[mode][1] else "0"}
        cmd = [sys.executable, "-m", "bench.scan_output_faults", "--out", "-", "--one", case, str(i), mode]
        if sanitizer and MODES[mode][1]:  # memcheck serialises launches anyway: the blocking mode's runs
            cmd = [sanitizer, "--tool", "memcheck", "--print-limit", "3", *cmd]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            entry = json.loads(line[7:]) if line and done.returncode == 0 else \
                {"fault": True, "rc": done.returncode, "tail": (done.stdout + done.stderr)[-1500:]}
        except subprocess.TimeoutExpired:
            entry = {"fault": None, "timeout_s": args.timeout}
        results[f"{case} / {config} / {mode}"] = entry
        print(case, config, mode, "FAULT" if entry.get("fault") else entry, flush=True)
        with open(args.out, "w") as f:  # after every run: a call cut short keeps what it found
            json.dump({"commit": os.environ.get("KEV_COMMIT"), "device": device, "sanitizer": sanitizer,
                       "modes": MODES, "results": results}, f, indent=1)

if __name__ == "__main__":
    main()
