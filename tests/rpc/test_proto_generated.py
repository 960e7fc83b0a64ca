"""The committed kev/v1 code is exactly what protoc makes of proto/kev/v1: nobody edits generated
code by hand, and a .proto change without regeneration fails here (fix: scripts/gen_proto.sh)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "kev" / "v1"
HAND_WRITTEN = {"__init__.py"}


def _committed() -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in GENERATED.iterdir()
        if p.is_file() and p.name not in HAND_WRITTEN and p.suffix in (".py", ".pyi")
    }


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto" / "kev" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto",
           f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "kev" / "v1").iterdir()}

    committed = _committed()
    assert sorted(fresh) == sorted(committed), "generated file set differs: run scripts/gen_proto.sh"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    # The generator's version is part of the output, so say which one ran.
    assert not stale, (
        f"{stale} differ from protoc output (grpcio-tools {version('grpcio-tools')}): run scripts/gen_proto.sh"
    )


def test_generated_modules_import() -> None:
    from kev.v1 import bank_pb2, bank_pb2_grpc, scorer_pb2, scorer_pb2_grpc

    assert scorer_pb2.DESCRIPTOR.package == "kev.v1"
    assert bank_pb2.DESCRIPTOR.package == "kev.v1"
    assert hasattr(scorer_pb2_grpc, "ScorerStub") and hasattr(bank_pb2_grpc, "BankStub")
    # Zero is reserved so an unset question type is detectable (INVALID_ARGUMENT).
    assert scorer_pb2.Question.TYPE_UNSPECIFIED == 0
