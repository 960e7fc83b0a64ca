"""Can this machine run bench/load_compare.py? Prints what each needed piece is, exits 1 if one is missing.

Checks the Python packages the services, the load generator and the baseline import (with their
versions: the generated kev.v1 code needs grpcio >= 1.85.1 and protobuf >= 7.35.1), fla for the
baseline's kernels, CUDA, and a `redis-server` binary on PATH that runs. On the GPU machine,
which has no redis-server and no package index, carry (see bench/load_compare.py's docstring):

    .whl       the project's fla wheel
    .whl_load  grpcio, grpcio-health-checking, grpcio-reflection, protobuf, redis (cp312 wheels)
    .redis_carry  redis-server (Debian 12's 7.0.15) + its uncommon libraries, behind a wrapper script

all three built on the CPU machine by `bash bench/device/device_carry.sh` (git-ignored), then here:

    python3 bench/device/device_check.py
"""

from __future__ import annotations

import importlib
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a script from the repo root

# (import name, distribution, required)
MODULES = [
    ("torch", "torch", True), ("triton", "triton", True), ("fla", "fla-core", True),
    ("transformers", "transformers", True), ("grpc", "grpcio", True),
    ("grpc_health.v1.health", "grpcio-health-checking", True), ("grpc_reflection.v1alpha.reflection",
                                                                "grpcio-reflection", True),
    ("google.protobuf", "protobuf", True), ("redis", "redis", True), ("prometheus_client", "prometheus-client", True),
    ("tokenizers", "tokenizers", True), ("safetensors", "safetensors", True), ("numpy", "numpy", True),
    ("kev.v1.scorer_pb2_grpc", None, True),  # the generated code's own version checks run at import
    ("matplotlib", "matplotlib", False),
]


def main() -> int:
    missing = []
    for module, dist, required in MODULES:
        try:
            importlib.import_module(module)
            version = importlib.metadata.version(dist) if dist else "imports"
            status = f"ok {version}"
        except Exception as e:  # noqa: BLE001 - report any import failure, keep checking
            status = f"MISSING ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
            if required:
                missing.append(module)
        print(f"{module:40s} {status}{'' if required else '  (optional: plots)'}")
    try:
        import torch

        cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    except Exception as e:  # noqa: BLE001
        cuda = f"torch failed: {e}"
    print(f"{'cuda':40s} {cuda}")
    redis = shutil.which("redis-server")
    if redis is None:
        print(f"{'redis-server':40s} MISSING on PATH (export PATH=$PWD/.redis_carry:$PATH)")
        missing.append("redis-server")
    else:
        run = subprocess.run([redis, "--version"], capture_output=True, text=True)
        ok = run.returncode == 0
        print(f"{'redis-server':40s} {'ok ' + run.stdout.strip() if ok else 'FAILS: ' + run.stderr.strip()[:200]}")
        if not ok:
            missing.append("redis-server")
    if missing:
        print(f"missing: {', '.join(missing)}")
        return 1
    print("everything bench/load_compare.py needs is here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
