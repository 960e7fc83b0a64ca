"""The repository's shell scripts parse (they run where CI cannot: the GPU machine, a fresh install)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.relative_to(ROOT) for p in ROOT.glob("*/*.sh") if ".venv" not in p.parts)


def test_the_scripts_are_found():
    assert {Path("bench/gpu_check.sh"), Path("bench/device_carry.sh"), Path("bench/load_check.sh")} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
