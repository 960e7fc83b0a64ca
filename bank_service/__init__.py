"""The bank service: owns the state bank memory, runs state passes, registers entries in Redis.

    python -m bank_service          (settings: docs/settings.md, flags: --help)

config.py (settings) -> server.py (gRPC, health, start/stop) -> acquire.py (look-up, batched
state passes, eviction, directory recovery) -> kev.exec.passes (a Runner; on CUDA class-tuned and
CUDA-graphed) / kev.bank.shared (memory others map).
"""
