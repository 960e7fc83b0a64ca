"""`kev convert`: a Kev run (adapter or full weights + head.pt + tokenizer) becomes a checkpoint
directory that answers exactly as the merged weights do; every bad head.pt is refused by name."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kev.engine import Engine
from kev.loading import LoadedModel
from kev.model.checkpoint import load_checkpoint
from kev.model.config import CheckpointError
from kev.model.convert import convert_run, read_run_head
from kev.request.api import Question, ScoreRequest
from kev.request.head import DecisionHead, save_head
from kev.rpc.cli import main as kev_main
from tiny_checkpoints import HEAD_NAMING, RUN_WORDS, make_hf_checkpoint, make_kev_run, make_run_head

W = RUN_WORDS


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("base") / "qwen-tiny")[0]


def _requests() -> list[ScoreRequest]:
    return [
        ScoreRequest(document=" ".join(W[i % len(W)] for i in range(seed, seed + 30)), questions={
            "yn": Question.noul(f"{W[seed]} {W[seed + 1]}"),
            "pick": Question.choice(f"{W[seed + 2]}", {W[3]: None, W[4]: W[5], W[6]: None}),
            "level": Question.score(f"{W[seed + 3]}", [W[7], W[8], W[9]]),
        })
        for seed in (0, 5, 11)
    ]


def _probabilities(checkpoint: Path, adapter: Path | None = None) -> torch.Tensor:
    engine = Engine.from_checkpoint(checkpoint, adapter, bank_bytes=4 << 20)
    out = []
    for response in engine.score_many(_requests()):
        a = response.answers
        out += [a["yn"].p_yes, *a["pick"].probabilities.values(), *a["level"].probabilities]
    return torch.tensor(out, dtype=torch.float64)


def _reference_merged(base: Path, run: Path, directory: Path) -> Path:
    """The merged weights written directly: W + (alpha / r) B A computed here from the run's files,
    the head from head.pt's tensors, the run's tokenizer."""
    directory.mkdir()
    shutil.copy(base / "config.json", directory / "config.json")
    weights = load_file(base / "model.safetensors")
    lora = load_file(run / "adapter_model.safetensors")
    cfg = json.loads((run / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    merged = 0
    for key in list(weights):
        a = lora.get(f"base_model.model.{key.removesuffix('.weight')}.lora_A.weight")
        if a is not None:
            b = lora[f"base_model.model.{key.removesuffix('.weight')}.lora_B.weight"]
            weights[key] = weights[key] + (b @ a) * scale
            merged += 1
    assert merged == len(lora) // 2
    save_file(weights, str(directory / "model.safetensors"))
    raw = torch.load(run / "head.pt", weights_only=True)
    names = HEAD_NAMING["proj"]
    save_head(directory / "head.safetensors", DecisionHead(*(raw["head"][n].float() for n in names),
                                                           temperature=raw["temperature"]))
    shutil.copy(run / "tokenizer.json", directory / "tokenizer.json")
    return directory


def test_converted_adapter_run_answers_as_the_merged_weights(base, tmp_path):
    run = make_kev_run(tmp_path / "kev-run@v2", base, naming="proj")
    out = tmp_path / "served"
    assert kev_main(["convert", str(run), str(out), "--base", str(base)]) == 0

    assert {p.name for p in out.iterdir()} == {
        "config.json", "model.safetensors", "adapter_config.json", "adapter_model.safetensors",
        "head.safetensors", "tokenizer.json", "kev.json"}
    meta = json.loads((out / "kev.json").read_text())
    assert meta == {"model_id": "kev-run-v2", "base": "Qwen/Qwen3.5-Tiny",
                    "base_revision": "0123456789abcdef0123456789abcdef01234567", "weights_dtype": "bfloat16"}
    assert (out / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    assert LoadedModel.load(out).model_id == "kev-run-v2"

    got = _probabilities(out)
    want = _probabilities(_reference_merged(base, run, tmp_path / "merged"))
    assert (got - want).abs().max() <= 1e-6, (got - want).abs().max()
    # The adapter matters, so the comparison means something: the base alone answers otherwise.
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (plain / name).unlink()
    assert (_probabilities(plain) - want).abs().max() > 1e-4


@pytest.mark.parametrize("naming,bias", [("w", True), ("kev", False)], ids=["w_q.weight+bias", "w_q-nobias"])
def test_full_weight_run(base, tmp_path, naming, bias):
    run = make_kev_run(tmp_path / "run", base, adapter=False, naming=naming, bias=bias, shards=2, temperature=2.5)
    out = convert_run(run, tmp_path / "out", model_id="kev-full")
    assert not (out / "adapter_config.json").exists()
    assert sorted(p.name for p in out.glob("model*")) == sorted(p.name for p in run.glob("model*"))
    loaded = LoadedModel.load(out)
    raw = torch.load(run / "head.pt", weights_only=True)["head"]
    names = HEAD_NAMING[naming]
    assert loaded.model_id == "kev-full" and loaded.head.temperature == 2.5
    assert torch.equal(loaded.head.w_q, raw[names[0]]) and torch.equal(loaded.head.w_k, raw[names[1]])
    assert (loaded.head.b_q is not None) == bias
    want = load_checkpoint(base).weights
    got = dict(loaded.model.state_dict())
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bf16_head_is_read_as_fp32(base, tmp_path):
    head = make_run_head(64, dtype=torch.bfloat16)
    torch.save(head, tmp_path / "head.pt")
    run = read_run_head(tmp_path / "head.pt", hidden_size=64)
    assert run.w_q.dtype == torch.float32 and torch.equal(run.w_q, head["head"]["q_proj.weight"].float())
    assert run.head_dim == 16 and run.temperature == 0.7


# ---- head.pt: every bad input refused with the file and what is wrong ----


def _head(**over):
    h = make_run_head(64)
    h.update(over)  # after the tensors are made: head_dim=8 keeps 16-row weights
    return h


def _without(key):
    h = _head()
    del h[key]
    return h


def _with_state(edit):
    h = _head()
    edit(h["head"])
    return h


BAD_HEADS = {
    "not-a-dict": ([1, 2, 3], "expected a dict"),
    "a-tensor": (torch.zeros(3), "expected a dict"),
    "missing-head": (_without("head"), "missing key 'head'"),
    "missing-temperature": (_without("temperature"), "missing key 'temperature'"),
    "missing-base": (_without("base"), "missing key 'base'"),
    "unknown-key": (_head(step=100), "unknown key 'step'"),
    "head-not-dict": (_head(head=[torch.zeros(16, 64)]), "'head' must be the head's state dict"),
    "no-known-naming": (_head(head={"query.weight": torch.zeros(16, 64)}), "accepted namings"),
    "mixed-naming": (_with_state(lambda s: s.update({"w_k.weight": s.pop("k_proj.weight")})), "mixes namings"),
    "missing-w_k": (_with_state(lambda s: s.pop("k_proj.weight")), "lacks 'k_proj.weight'"),
    "one-bias": (_with_state(lambda s: s.pop("k_proj.bias")), "both biases or neither"),
    "rows-not-head_dim": (_head(head_dim=8), "expected [8, 64]"),
    "hidden-not-base": (_with_state(lambda s: s.update({"q_proj.weight": torch.zeros(16, 32),
                                                         "k_proj.weight": torch.zeros(16, 32)})), "expected [16, 64]"),
    "bias-shape": (_with_state(lambda s: s.update({"q_proj.bias": torch.zeros(15)})), "expected [16]"),
    "int-dtype": (_with_state(lambda s: s.update({"q_proj.weight": torch.zeros(16, 64, dtype=torch.int32)})),
                  "torch.int32"),
    "not-a-tensor": (_with_state(lambda s: s.update({"q_proj.weight": [[0.0] * 64] * 16})), "expected a tensor"),
    "nan-weight": (_with_state(lambda s: s["q_proj.weight"].__setitem__((0, 0), float("nan"))), "non-finite"),
    "temperature-zero": (_head(temperature=0.0), "'temperature' is 0.0"),
    "temperature-inf": (_head(temperature=float("inf")), "'temperature' is inf"),
    "temperature-str": (_head(temperature="1.0"), "'temperature' must be a number"),
    "temperature-vector": (_head(temperature=torch.ones(2)), "'temperature' is a torch.float32 tensor of shape [2]"),
    "head_dim-bool": (_head(head_dim=True), "'head_dim' must be a positive int"),
    "base-empty": (_head(base=""), "'base' must be a non-empty string"),
    "lora-str": (_head(lora="yes"), "'lora' must be"),
    "weights_dtype-int8": (_head(weights_dtype="int8"), "'weights_dtype' 'int8'"),
}


@pytest.mark.parametrize("case", BAD_HEADS)
def test_bad_head_pt_is_refused(tmp_path, case):
    obj, needle = BAD_HEADS[case]
    torch.save(obj, tmp_path / "head.pt")
    with pytest.raises(CheckpointError) as err:
        read_run_head(tmp_path / "head.pt", hidden_size=64)
    assert str(tmp_path / "head.pt") in str(err.value) and needle in str(err.value), str(err.value)


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('pwned')",)


def test_code_in_a_pickle_is_never_run(tmp_path):
    marker = tmp_path / "pwned"
    head = _head()
    head["head"]["q_proj.weight"] = _Exploit(marker)
    torch.save(head, tmp_path / "head.pt")
    with pytest.raises(CheckpointError, match="weights_only=True") as err:
        read_run_head(tmp_path / "head.pt", hidden_size=64)
    assert "nothing in it was executed" in str(err.value)
    assert not marker.exists()
    # The file is a real exploit: an unrestricted load would have run it.
    torch.load(tmp_path / "head.pt", weights_only=False)
    assert marker.read_text() == "pwned"


def test_raw_pickle_and_garbage_are_refused(tmp_path):
    (tmp_path / "head.pt").write_bytes(pickle.dumps({"base": "x"}) + b"garbage")
    with pytest.raises(CheckpointError, match="head.pt"):
        read_run_head(tmp_path / "head.pt")
    (tmp_path / "head.pt").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="head.pt"):
        read_run_head(tmp_path / "head.pt")


# ---- what convert refuses about the run and the base ----


def test_cli_reports_errors_and_writes_nothing(base, tmp_path, capsys):
    run = make_kev_run(tmp_path / "run", base)
    torch.save(_head(head_dim=8, lora=True), run / "head.pt")
    assert kev_main(["convert", str(run), str(tmp_path / "out"), "--base", str(base)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kev convert: ") and "head.pt" in err and "expected [8, 64]" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_adapter_run_needs_its_base(base, tmp_path):
    run = make_kev_run(tmp_path / "run", base)
    with pytest.raises(CheckpointError, match="--base"):
        convert_run(run, tmp_path / "out")


def test_existing_output_needs_force(base, tmp_path):
    run = make_kev_run(tmp_path / "run", base)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    with pytest.raises(CheckpointError, match="already exists"):
        convert_run(run, tmp_path / "out", base, check=False)
    convert_run(run, tmp_path / "out", base, overwrite=True)
    assert not (tmp_path / "out" / "old").exists() and (tmp_path / "out" / "head.safetensors").exists()


def test_lora_field_must_match_the_run(base, tmp_path):
    run = make_kev_run(tmp_path / "run", base, lora=False)
    with pytest.raises(CheckpointError, match="'lora' is False, but the run directory holds an adapter"):
        convert_run(run, tmp_path / "out", base)
    torch.save(make_run_head(64, lora={"r": 8, "lora_alpha": 8}), run / "head.pt")
    with pytest.raises(CheckpointError, match=r"'lora'\['r'\] is 8, but adapter_config.json says 4"):
        convert_run(run, tmp_path / "out", base)


def test_base_snapshot_must_be_the_named_base(base, tmp_path):
    run = make_kev_run(tmp_path / "run", base)
    wrong_rev = shutil.copytree(base, tmp_path / "hub" / "models--Qwen--Qwen3.5-Tiny" / "snapshots" / ("f" * 40))
    with pytest.raises(CheckpointError, match="revision"):
        convert_run(run, tmp_path / "out", wrong_rev)
    wrong_repo = shutil.copytree(base, tmp_path / "hub" / "models--Qwen--Qwen3.5-9B" / "snapshots"
                                 / "0123456789abcdef0123456789abcdef01234567")
    with pytest.raises(CheckpointError, match="Qwen3.5-9B"):
        convert_run(run, tmp_path / "out", wrong_repo)
    right = shutil.copytree(base, tmp_path / "hub" / "models--Qwen--Qwen3.5-Tiny" / "snapshots"
                            / "0123456789abcdef0123456789abcdef01234567")
    convert_run(run, tmp_path / "out", right, link=True)
    assert (tmp_path / "out" / "model.safetensors").stat().st_ino == (right / "model.safetensors").stat().st_ino


def test_adapter_of_another_base_is_refused(base, tmp_path):
    other, _ = make_hf_checkpoint(tmp_path / "other", overrides={"intermediate_size": 80})
    run = make_kev_run(tmp_path / "run", other)
    with pytest.raises(CheckpointError, match="adapter_model.safetensors"):
        convert_run(run, tmp_path / "out", base)
    assert not (tmp_path / "out").exists()


def test_bad_model_id_is_refused(base, tmp_path):
    run = make_kev_run(tmp_path / "run", base)
    with pytest.raises(CheckpointError, match="model id 'a@b'"):
        convert_run(run, tmp_path / "out", base, model_id="a@b")
