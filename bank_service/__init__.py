"""The bank service: owns the state bank memory, runs state passes, registers entries in Redis.

    python -m bank_service          (settings: docs/settings.md, flags: --help)

config.py (settings) -> server.py (gRPC, health, start/stop) -> acquire.py (look-up, batched
state passes, eviction, directory recovery) -> kev.exec.passes (a Passes; on CUDA class-tuned and
CUDA-graphed) / kev.bank.shared (memory others map). Settings loading, errors with their gRPC
status (Acquire's failures are kev.serving.errors) and the gRPC server are kev/serving's (shared
with the scorer).
"""
