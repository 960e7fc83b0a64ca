"""The repository's shell scripts parse (they run where CI cannot: the GPU machine, a fresh install),
and a device call's files are sorted into bench/results and runs/ (bench/device/collect.py)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.relative_to(ROOT) for pattern in ("*/*.sh", "*/*/*.sh") for p in ROOT.glob(pattern)
                 if not {".venv", ".git", "runs"} & set(p.relative_to(ROOT).parts))
DEVICE = ("gpu_check.sh", "load_check.sh", "load_ab.sh", "load_profile.sh", "triton_cache.sh", "load_env.sh",
          "device_carry.sh")


def test_the_scripts_are_found():
    assert {Path("bench/device") / name for name in DEVICE} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_device_scripts_name_their_new_paths():
    """The drivers cd to the repository root from bench/device/ and call each other there."""
    for name in ("gpu_check.sh", "load_check.sh", "load_ab.sh", "device_carry.sh"):
        text = (ROOT / "bench/device" / name).read_text()
        assert 'cd "$(dirname "$0")/../.."' in text, name
    for name in DEVICE + ("device_check.py",):
        text = (ROOT / "bench/device" / name).read_text()
        old = [f"bench/{n}" for n in DEVICE + ("device_check.py",) if f"bench/{n}" in text]
        assert not old, f"{name} still names {old}"
    # the device tool returns 8 files: a four-workload call's JSONs, log, CSV and cache parts, no plots
    assert '--png-dir "$OUT"' not in (ROOT / "bench/device/load_check.sh").read_text()


def test_the_gpu_test_groups_hold_every_gpu_test_once():
    """gpu_check.sh's halves (tests-a, tests-b = its kernels + tests-c) name every file with a GPU
    test, each in one half: a new GPU test file never goes unrun on the device."""
    text = (ROOT / "bench/device/gpu_check.sh").read_text()
    arrays = re.findall(r"^GPU_TESTS\w*=\([^)]*\)", text, re.M)  # the groups' assignments, run alone
    script = "\n".join(arrays) + '\necho "${GPU_TESTS_A[@]}"; echo "${GPU_TESTS_B[@]}"; echo "${GPU_TESTS_C[@]}"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    a, b, c = (line.split() for line in out.stdout.splitlines())
    gpu = re.compile(r"^(pytestmark = pytest\.mark\.gpu|@pytest\.mark\.gpu)", re.M)
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if gpu.search(p.read_text())}
    assert sorted(a + b) == sorted(marked) and len(set(a + b)) == len(a + b)
    assert set(c) < set(b) and "tests/ops/test_kernels_gpu.py" not in c


def test_gpu_sharing_is_time_sliced_unless_mps_is_asked_for(monkeypatch):
    """Without KEV_MPS the helper starts nothing and records time slicing, for both load scripts."""
    monkeypatch.delenv("KEV_MPS", raising=False)
    out = subprocess.run(["bash", "-c", "source bench/device/load_env.sh && gpu_sharing_start && "
                          "echo \"recorded $KEV_GPU_SHARING\""], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "recorded time-sliced", out
    for name in ("load_check.sh", "load_profile.sh"):
        assert "source bench/device/load_env.sh\nload_env" in (ROOT / "bench/device" / name).read_text(), name
    assert "    gpu_sharing_start\n}" in (ROOT / "bench/device/load_env.sh").read_text()


def test_results_keep_plain_names():
    """bench/results holds one JSON per benchmark under its plain name, no commit in it, and RESULTS.md."""
    files = [p for p in (ROOT / "bench/results").iterdir()]
    assert {p.name for p in files if p.suffix != ".json"} == {"RESULTS.md"}
    for p in files:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            first = data[0] if isinstance(data, list) else data
            assert first.get("commit"), f"{p.name} has no commit inside"
            assert first["commit"][:7] not in p.stem, f"{p.name} is named by its commit"


def test_collect_sorts_a_device_call(tmp_path):
    from bench.device.collect import collect

    src, root = tmp_path / "files_at", tmp_path / "repo"
    (src / "a_1").mkdir(parents=True)
    (src / "single_request.json").write_text(json.dumps({"commit": "abc1234", "gpu": "H200"}))
    (src / "load_mixed.json").write_text(json.dumps({"commit": "abc1234", "complete": False, "missing": ["baseline"]}))
    (src / "autotune_classes.json").write_text(json.dumps({"commit": "unknown"}))
    (src / "gpu_tests.log").write_text("46 passed")
    (src / "a_1" / "load_six-short.json").write_text(json.dumps({"commit": "abc1234"}))
    (src / "triton_cache.txz.part00").write_bytes(b"xz")
    (root / "bench/results").mkdir(parents=True)
    (root / "bench/results/load_mixed.json").write_text("the complete one")
    (root / ".triton_carry").mkdir()
    (root / ".triton_carry/triton_cache.txz.part01").write_bytes(b"old")
    src.joinpath("single_request.json").chmod(0o444)  # the device tool's copies are read-only

    done = collect(src, root, stamp="t")
    assert done["results"] == ["single_request.json"]
    assert [name for name, _ in done["kept_out"]] == ["autotune_classes.json", "load_mixed.json"]
    assert (root / "bench/results/load_mixed.json").read_text() == "the complete one"
    assert not (root / "bench/results/load_six-short.json").exists()  # an A/B run's file stays in its folder
    run = root / "runs/t_abc1234"
    assert {p.name for p in run.iterdir()} == {"single_request.json", "load_mixed.json", "autotune_classes.json",
                                               "gpu_tests.log", "a_1"}
    assert (run / "a_1/load_six-short.json").exists()
    assert sorted(p.name for p in (root / ".triton_carry").iterdir()) == ["triton_cache.txz.part00"]
    collect(src, root, stamp="t")  # again: the read-only source copied over its own earlier copies
    assert (root / "bench/results/single_request.json").stat().st_mode & 0o200


def test_a_call_with_more_files_than_come_back_is_bundled_and_collected(tmp_path):
    """triton_cache.sh's out_bundle packs $OUT into one files.tgz once it holds more than the tool
    returns beside the cache's parts; collect unpacks it and sorts it as if the files came back."""
    from bench.device.collect import collect

    out, root = tmp_path / "out", tmp_path / "repo"
    (out / "load_shapes").mkdir(parents=True)
    (out / "kernel_floors.json").write_text(json.dumps({"commit": "abc1234"}))
    for i in range(6):
        (out / "load_shapes" / f"row_pass_{i}.txt").write_text(str(i))
    few = tmp_path / "few"
    few.mkdir()
    (few / "single_request.json").write_text(json.dumps({"commit": "abc1234"}))
    for folder in (out, few):
        script = f"source {ROOT}/bench/device/triton_cache.sh; OUT={folder} out_bundle"
        subprocess.run(["bash", "-c", script], check=True, capture_output=True)
    assert [p.name for p in out.iterdir()] == ["files.tgz"]
    assert [p.name for p in few.iterdir()] == ["single_request.json"]  # five files or fewer: left as they are

    (out / "triton_cache.txz.part00").write_bytes(b"xz")
    done = collect(out, root, stamp="t")
    assert done["results"] == ["kernel_floors.json"] and done["cache"] == ["triton_cache.txz.part00"]
    run = root / "runs/t_abc1234"
    assert {p.name for p in run.iterdir()} == {"kernel_floors.json", "load_shapes"}
    assert (run / "load_shapes/row_pass_5.txt").read_text() == "5"


def test_pass_configs_rejects_an_unknown_kernel_before_building_anything():
    """Session 37 lost 89 s of device time to `--kernels conv` failing after the warm-up."""
    result = subprocess.run([sys.executable, "-m", "bench.pass_configs", "--kernels", "indexed_scan,conv"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2
    assert "unknown --kernels ['conv']" in result.stderr and "indexed_conv" in result.stderr
