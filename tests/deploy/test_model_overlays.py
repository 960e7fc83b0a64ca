"""The per-model H100 overlays (deploy/overlays/h100-kev-*, deploy/components/models/) and the
memory table of deploy/README.md against `bench/memory_budget.py`, which computes both from the
services' own start-up plan (`kev.exec.memory.memory_plan`).

Each model overlay renders, validates strictly against the Kubernetes schemas, and differs from
overlays/h100 (which tests/deploy/test_deploy.py checks in full) only in the model's checkpoint
directory, its bank size and, for Kev-27B, the bank container's host memory. The banks of all H100
overlays (Kev-4B's in components/h100) are the budget's for an H100 80GB, and the README's table
and docs/models.md's family table are the script's output, verbatim.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from test_deploy import DEPLOY, KUBE_VERSIONS, ROOT, _container, _env, _kustomize, _pod_spec, tools  # noqa: F401

try:  # `python -m pytest` from the repo root has it on sys.path; a bare `pytest` may not
    import bench  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

from bench.common import KEV_MODELS  # noqa: E402
from bench.memory_budget import budget, family_table, table  # noqa: E402

MODELS = [m for m in KEV_MODELS if m != "kev-4b"]  # Kev-4B is overlays/h100 itself
H100 = "H100 80GB"


@pytest.fixture(scope="module")
def renders(tools) -> dict[str, list[dict]]:
    return {name: _kustomize(tools, DEPLOY / "overlays" / name) for name in ["h100", *(f"h100-{m}" for m in MODELS)]}


@pytest.mark.parametrize("model", MODELS)
def test_model_overlay_validates_strictly(renders, model):
    import kubernetes_validate

    errors = []
    for obj in renders[f"h100-{model}"]:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} @ {version}: {e.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("model", MODELS)
def test_model_overlay_changes_only_the_model_and_its_bank(renders, model):
    base, objs = renders["h100"], copy.deepcopy(renders[f"h100-{model}"])
    spec = _pod_spec(objs)
    bank, scorer = _container(spec, "bank"), _container(spec, "scorer")
    for c in (bank, scorer):
        assert _env(c)["KEV_CHECKPOINT"]["value"] == f"/models/{model}"
        _env(c)["KEV_CHECKPOINT"]["value"] = "/models/kev-4b"
    assert int(_env(bank)["KEV_BANK_MEMORY_BYTES"]["value"]) == budget(model, H100).bank_bytes
    _env(bank)["KEV_BANK_MEMORY_BYTES"]["value"] = _env(_container(_pod_spec(base), "bank"))[
        "KEV_BANK_MEMORY_BYTES"]["value"]
    if model == "kev-27b":  # room to read ~51 GB of weights on the host before they move to the GPU
        assert bank["resources"]["requests"]["memory"] == bank["resources"]["limits"]["memory"] == "64Gi"
        bank["resources"] = _container(_pod_spec(base), "bank")["resources"]
    assert env_sorted(objs) == env_sorted(base)


def env_sorted(objs: list[dict]) -> list[dict]:
    """The objects with every container's env in name order (a patch may move a variable)."""
    objs = copy.deepcopy(objs)
    for obj in objs:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in [*pod.get("containers", []), *pod.get("initContainers", [])]:
            if "env" in c:
                c["env"] = sorted(c["env"], key=lambda e: e["name"])
    return objs


def test_every_h100_bank_is_the_budgets(renders):
    for name, objs in renders.items():
        model = "kev-4b" if name == "h100" else name.removeprefix("h100-")
        bank = _container(_pod_spec(objs), "bank")
        assert int(_env(bank)["KEV_BANK_MEMORY_BYTES"]["value"]) == budget(model, H100).bank_bytes, name
        assert budget(model, H100).fits


def test_readme_and_models_tables_are_the_scripts():
    assert table() in (DEPLOY / "README.md").read_text(), "rerun python -m bench.memory_budget into deploy/README.md"
    assert family_table() in (ROOT / "docs" / "models.md").read_text(), \
        "rerun python -m bench.memory_budget --family into docs/models.md"
