"""Checkpoint loading against transformers' own Qwen3.5 model, layouts, errors, LoRA merge."""

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kev.model.checkpoint import expected_shapes, load_checkpoint, read_config, read_weights
from kev.model.config import CheckpointError
from kev.model.lora import merge_lora
from tiny_checkpoints import hide_fla, lora_hooks, make_hf_checkpoint, make_lora_adapter
from kernel_support import rel_err

TOKENS = 80  # past one 64-token chunk of the reference's chunked delta rule


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "flat")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "sharded", shards=2)


@pytest.fixture
def flat_copy(flat, tmp_path):
    return Path(shutil.copytree(flat[0], tmp_path / "copy"))


@pytest.fixture
def sharded_copy(sharded, tmp_path):
    return Path(shutil.copytree(sharded[0], tmp_path / "copy"))


# HV/H changes every DeltaNet shape and the attention bias adds tensors: one case each.
@pytest.mark.parametrize(
    "hv_per_h,bias", [(1, False), (2, False), (3, False), (2, True)], ids=["hv1", "hv2", "hv3", "hv2-bias"]
)
def test_weights_match_hf_text_model(tmp_path, hv_per_h, bias):
    path, hf = make_hf_checkpoint(tmp_path, hv_per_h=hv_per_h, overrides={"attention_bias": bias})
    ck = load_checkpoint(path)
    ref = hf.model.state_dict()  # Qwen3_5TextModel: the names kev.model.qwen35 uses
    assert expected_shapes(ck.config) == {k: tuple(v.shape) for k, v in ref.items()}
    assert list(ck.weights) == list(expected_shapes(ck.config))
    assert all(torch.equal(ck.weights[k], ref[k]) for k in ref)


@pytest.mark.parametrize(
    "layout",
    [dict(nested=True), dict(shards=2), dict(nested=True, shards=3)],
    ids=["nested", "sharded", "nested-sharded"],
)
def test_layouts_load_identically(flat, tmp_path, layout):
    path, _ = make_hf_checkpoint(tmp_path, **layout)
    assert read_config(path).nested == layout.get("nested", False)
    got, want = load_checkpoint(path).weights, load_checkpoint(flat[0]).weights
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_nested_ignores_visual_mtp_and_untied_head(tmp_path):
    path, hf = make_hf_checkpoint(tmp_path, nested=True, tied=False)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        stored = set(f.keys())
    assert {"lm_head.weight", "mtp.fc.weight", "model.visual.blocks.0.attn.qkv.weight"} <= stored
    ck = load_checkpoint(path)
    assert not ck.config.tie_word_embeddings
    assert not [k for k in ck.weights if "visual" in k or "mtp" in k or "lm_head" in k]
    ref = hf.model.state_dict()
    assert all(torch.equal(ck.weights[k], ref[k]) for k in ref)


def test_bf16_is_one_cast_of_the_stored_weights(flat):
    fp32 = load_checkpoint(flat[0]).weights
    bf16 = load_checkpoint(flat[0], dtype=torch.bfloat16).weights
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)


def test_hide_fla_runs_the_torch_path(flat):
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    before = modeling.torch_chunk_gated_delta_rule
    hf = flat[1]
    ids = torch.randint(0, 300, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with hide_fla() as calls, torch.no_grad():
        out = hf.model(ids).last_hidden_state
    n_deltanet = len(read_config(flat[0]).deltanet_layers)
    assert calls["torch_chunk_gated_delta_rule"] == n_deltanet and calls["causal_conv1d_fn"] == n_deltanet
    assert torch.isfinite(out).all()
    assert modeling.torch_chunk_gated_delta_rule is before  # restored


# ---- errors: each names the file and, where there is one, the tensor ----


def _edit_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _set_layer_type(raw):
    raw["layer_types"][1] = "sliding_attention"


FLAT_ERRORS = {
    "missing-config": (lambda d: (d / "config.json").unlink(), ["config.json", "not found"]),
    "bad-config-json": (lambda d: (d / "config.json").write_text("{"), ["config.json", "JSON"]),
    "unknown-model-type": (
        lambda d: _edit_json(d / "config.json", lambda r: r.update(model_type="llama")),
        ["config.json", "'llama'"],
    ),
    "unsupported-layer-type": (
        lambda d: _edit_json(d / "config.json", _set_layer_type),
        ["config.json", "unsupported layer type 'sliding_attention'"],
    ),
    "bad-head-ratio": (
        lambda d: _edit_json(d / "config.json", lambda r: r.update(linear_num_value_heads=3)),
        ["config.json", "linear_num_value_heads 3"],
    ),
    "missing-weights": (lambda d: (d / "model.safetensors").unlink(), ["model.safetensors", "not found"]),
    "pickle-only": (
        lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
        ["model.safetensors", "pytorch_model.bin", "never loaded"],
    ),
    "corrupt-weights": (
        lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage"),
        ["model.safetensors", "not a readable safetensors"],
    ),
    "missing-tensor": (
        lambda d: _edit_tensors(d / "model.safetensors", lambda t: t.pop("model.layers.1.linear_attn.A_log")),
        ["model.safetensors", "'model.layers.1.linear_attn.A_log'"],
    ),
    "shape-mismatch": (
        lambda d: _edit_tensors(
            d / "model.safetensors", lambda t: t.update({"model.layers.3.self_attn.q_proj.weight": torch.zeros(64, 64)})
        ),
        ["model.safetensors", "'model.layers.3.self_attn.q_proj.weight'", "(64, 64)", "(128, 64)"],
    ),
    "unexpected-tensor": (
        lambda d: _edit_tensors(
            d / "model.safetensors", lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)})
        ),
        ["model.safetensors", "'model.layers.0.extra.weight'"],
    ),
    "integer-tensor": (
        lambda d: _edit_tensors(
            d / "model.safetensors", lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)})
        ),
        ["model.safetensors", "'model.norm.weight'", "int32"],
    ),
}


@pytest.mark.parametrize("case", FLAT_ERRORS)
def test_flat_errors_name_file_and_tensor(flat_copy, case):
    mutate, needles = FLAT_ERRORS[case]
    mutate(flat_copy)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(flat_copy)
    assert all(n in str(err.value) for n in needles), str(err.value)


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def _index_drop_one(raw):
    raw["weight_map"].pop("model.norm.weight")


INDEX_ERRORS = {
    "bad-json": (lambda d: (d / INDEX).write_text("[1,"), [INDEX, "JSON"]),
    "no-weight-map": (lambda d: _edit_json(d / INDEX, lambda r: r.pop("weight_map")), [INDEX, "weight_map"]),
    "missing-shard": (lambda d: (d / SHARD2).unlink(), [INDEX, SHARD2, "missing"]),
    "escaping-path": (
        lambda d: _edit_json(d / INDEX, lambda r: r["weight_map"].update({"model.norm.weight": "../x.safetensors"})),
        [INDEX, "'model.norm.weight'", "../x.safetensors"],
    ),
    "lists-absent-tensor": (
        lambda d: _edit_json(d / INDEX, lambda r: r["weight_map"].update({"model.ghost.weight": SHARD1})),
        [SHARD1, "'model.ghost.weight'"],
    ),
    "omits-stored-tensor": (lambda d: _edit_json(d / INDEX, _index_drop_one), ["'model.norm.weight'", INDEX]),
    "also-single-file": (lambda d: shutil.copy(d / SHARD1, d / "model.safetensors"), [INDEX, "model.safetensors"]),
}


@pytest.mark.parametrize("case", INDEX_ERRORS)
def test_index_errors_name_file_and_tensor(sharded_copy, case):
    mutate, needles = INDEX_ERRORS[case]
    mutate(sharded_copy)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(sharded_copy)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_nested_names_in_a_flat_checkpoint_are_unexpected(flat_copy):
    _edit_tensors(
        flat_copy / "model.safetensors",
        lambda t: t.update({"model.language_model.norm.weight": t["model.norm.weight"].clone()}),
    )
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.language_model.norm.weight'"):
        load_checkpoint(flat_copy)


# ---- LoRA ----


@pytest.mark.parametrize("nested,rslora", [(False, False), (True, True)], ids=["flat", "nested-rslora"])
def test_lora_merge_equals_unmerged_adapter(tmp_path, nested, rslora):
    path, hf = make_hf_checkpoint(tmp_path / "base", nested=nested)
    adapter = make_lora_adapter(tmp_path / "lora", path, rank=4, alpha=8, seed=3, use_rslora=rslora)
    ids = torch.randint(0, 300, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    with hide_fla(), torch.no_grad():
        base_out = hf.model(ids).last_hidden_state
        with lora_hooks(hf, adapter) as hooked:
            unmerged = hf.model(ids).last_hidden_state
        merged_model = copy.deepcopy(hf)
        merged_model.model.load_state_dict(load_checkpoint(path, adapter).weights)
        merged = merged_model.model(ids).last_hidden_state
    assert hooked == 3 * 5 + 1 * 4 + 4 * 3  # every DeltaNet, attention and MLP projection
    assert rel_err(unmerged, base_out) > 0.05  # the adapter matters, so the comparison means something
    assert rel_err(unmerged, merged) <= 1e-5


def test_lora_rounds_once_to_bf16(flat, tmp_path):
    adapter = make_lora_adapter(tmp_path / "lora", flat[0], seed=5)
    got = load_checkpoint(flat[0], adapter, dtype=torch.bfloat16).weights
    base = read_weights(flat[0], read_config(flat[0]))
    lora = load_file(adapter / "adapter_model.safetensors")
    twice_differs = False
    for name, w in base.items():
        module = "base_model.model.model." + name.removesuffix(".weight")
        if module + ".lora_A.weight" not in lora:
            assert torch.equal(got[name], w.to(torch.bfloat16)), name
            continue
        delta = (lora[module + ".lora_B.weight"] @ lora[module + ".lora_A.weight"]) * (8 / 4)
        assert torch.equal(got[name], (w + delta).to(torch.bfloat16)), name
        twice_differs |= not torch.equal(got[name], (w.to(torch.bfloat16).float() + delta).to(torch.bfloat16))
    assert twice_differs  # rounding the base first would have given other weights


def _drop(key):
    return lambda t: t.pop(key)


LORA_KEY = "base_model.model.model.layers.0.linear_attn.in_proj_qkv"
LORA_ERRORS = {
    "missing-B": (
        lambda d: _edit_tensors(d / "adapter_model.safetensors", _drop(LORA_KEY + ".lora_B.weight")),
        ["adapter_model.safetensors", "'layers.0.linear_attn.in_proj_qkv'", "lora_B"],
    ),
    "shape-mismatch": (
        lambda d: _edit_tensors(
            d / "adapter_model.safetensors", lambda t: t.update({LORA_KEY + ".lora_A.weight": torch.zeros(4, 63)})
        ),
        ["adapter_model.safetensors", "'layers.0.linear_attn.in_proj_qkv'", "(4, 63)", "(4, 64)"],
    ),
    "rank-mismatch": (
        lambda d: _edit_json(d / "adapter_config.json", lambda r: r.update(r=8)),
        ["adapter_model.safetensors", "(8, 64)"],
    ),
    "unknown-target": (
        lambda d: _edit_json(d / "adapter_config.json", lambda r: r["target_modules"].append("conv1d")),
        ["adapter_config.json", "'conv1d'"],
    ),
    "target-not-listed": (
        lambda d: _edit_json(d / "adapter_config.json", lambda r: r["target_modules"].remove("o_proj")),
        ["adapter_model.safetensors", "'o_proj'", "target_modules"],
    ),
    "module-not-in-model": (
        lambda d: _edit_tensors(
            d / "adapter_model.safetensors",
            lambda t: t.update(
                {
                    "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
                    "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight": torch.zeros(96, 4),
                }
            ),
        ),
        ["adapter_model.safetensors", "'layers.9.mlp.up_proj'"],
    ),
    "unexpected-tensor": (
        lambda d: _edit_tensors(
            d / "adapter_model.safetensors",
            lambda t: t.update({LORA_KEY + ".lora_magnitude_vector": torch.zeros(128)}),
        ),
        ["adapter_model.safetensors", "lora_magnitude_vector"],
    ),
    "dora": (
        lambda d: _edit_json(d / "adapter_config.json", lambda r: r.update(use_dora=True)),
        ["adapter_config.json", "use_dora"],
    ),
    "not-lora": (
        lambda d: _edit_json(d / "adapter_config.json", lambda r: r.update(peft_type="IA3")),
        ["adapter_config.json", "IA3"],
    ),
    "missing-config": (lambda d: (d / "adapter_config.json").unlink(), ["adapter_config.json", "not found"]),
    "pickled-adapter": (
        lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
        ["adapter_model.safetensors", "adapter_model.bin", "never loaded"],
    ),
}


@pytest.mark.parametrize("case", LORA_ERRORS)
def test_lora_errors_name_file_and_module(flat, tmp_path, case):
    adapter = make_lora_adapter(tmp_path / "lora", flat[0])
    mutate, needles = LORA_ERRORS[case]
    mutate(adapter)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(flat[0], adapter)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_lora_on_lm_head_is_ignored(flat, tmp_path):
    adapter = make_lora_adapter(tmp_path / "lora", flat[0])
    plain = load_checkpoint(flat[0], adapter).weights
    _edit_json(adapter / "adapter_config.json", lambda r: r["target_modules"].append("lm_head"))
    _edit_tensors(
        adapter / "adapter_model.safetensors",
        lambda t: t.update(
            {
                "base_model.model.lm_head.lora_A.weight": torch.ones(4, 64),
                "base_model.model.lm_head.lora_B.weight": torch.ones(300, 4),
            }
        ),
    )
    got = load_checkpoint(flat[0], adapter).weights
    assert all(torch.equal(got[k], plain[k]) for k in plain)


def test_merge_refuses_rounded_base(flat, tmp_path):
    adapter = make_lora_adapter(tmp_path / "lora", flat[0])
    config = read_config(flat[0])
    with pytest.raises(ValueError, match="fp32"):
        merge_lora(read_weights(flat[0], config, dtype=torch.bfloat16), adapter, config)


# ---- side files: head, tokenizer, kev.json ----


def test_side_files_and_meta(flat_copy, tmp_path):
    ck = load_checkpoint(flat_copy)
    assert (ck.head_path, ck.tokenizer_path, ck.meta.model_id, dict(ck.meta.delimiters)) == (None, None, "copy", {})
    with pytest.raises(CheckpointError, match="head.safetensors"):
        load_checkpoint(flat_copy, require_head=True)

    (flat_copy / "head.safetensors").write_bytes(b"")  # located only; kev.request.head reads it
    (flat_copy / "tokenizer.json").write_text("{}")
    (flat_copy / "kev.json").write_text(json.dumps({"model_id": "kev-tiny", "delimiters": {"decide": "<|x|>"}}))
    ck = load_checkpoint(flat_copy, require_head=True, require_tokenizer=True)
    assert ck.head_path == flat_copy / "head.safetensors" and ck.tokenizer_path == flat_copy / "tokenizer.json"
    assert ck.meta.model_id == "kev-tiny" and ck.meta.delimiters == {"decide": "<|x|>"}

    # A Kev release beside its adapter: its head wins, the id defaults to its name.
    adapter = make_lora_adapter(tmp_path / "kev-lora", flat_copy)
    (adapter / "head.safetensors").write_bytes(b"")
    (flat_copy / "kev.json").unlink()
    ck = load_checkpoint(flat_copy, adapter)
    assert ck.head_path == adapter / "head.safetensors" and ck.tokenizer_path == flat_copy / "tokenizer.json"
    assert ck.meta.model_id == "kev-lora"


@pytest.mark.parametrize(
    "meta,needle",
    [({"model": "x"}, "'model'"), ({"delimiters": {"answer": "x"}}, "'answer'"), ({"model_id": ""}, "model_id")],
    ids=["unknown-field", "unknown-role", "empty-id"],
)
def test_bad_kev_json(flat_copy, meta, needle):
    (flat_copy / "kev.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="kev.json") as err:
        load_checkpoint(flat_copy)
    assert needle in str(err.value)


def test_rslora_scale_reads_alpha_over_sqrt_r(flat, tmp_path):
    from kev.model.lora import read_adapter_config

    adapter = make_lora_adapter(tmp_path / "lora", flat[0], rank=4, alpha=8, use_rslora=True)
    assert read_adapter_config(adapter).scale == 8 / math.sqrt(4)


# ---- an adapter inside the checkpoint directory (what `kev convert` writes) ----


def _adapter_inside(base: Path, directory: Path, seed: int = 4) -> Path:
    ckpt = Path(shutil.copytree(base, directory))
    make_lora_adapter(ckpt, base, seed=seed)
    return ckpt


def test_adapter_in_the_checkpoint_directory_is_merged(flat, tmp_path):
    ckpt = _adapter_inside(flat[0], tmp_path / "kev-run")
    separate = make_lora_adapter(tmp_path / "lora", flat[0], seed=4)
    got, want = load_checkpoint(ckpt).weights, load_checkpoint(flat[0], separate).weights
    base = load_checkpoint(flat[0]).weights
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(got["layers.0.mlp.up_proj.weight"], base["layers.0.mlp.up_proj.weight"])
    assert load_checkpoint(ckpt, ckpt).meta.model_id == "kev-run"  # naming itself as the adapter is the same thing


def test_a_second_adapter_or_a_stray_adapter_file_is_refused(flat, tmp_path):
    ckpt = _adapter_inside(flat[0], tmp_path / "kev-run")
    other = make_lora_adapter(tmp_path / "lora", flat[0], seed=5)
    with pytest.raises(CheckpointError, match="holds an adapter and another one was given"):
        load_checkpoint(ckpt, other)
    (ckpt / "adapter_config.json").unlink()
    with pytest.raises(CheckpointError, match="adapter weights without adapter_config.json"):
        load_checkpoint(ckpt)


def test_a_run_directory_without_base_says_how_to_serve_it(flat, tmp_path):
    run = make_lora_adapter(tmp_path / "run", flat[0])
    with pytest.raises(CheckpointError, match="no base model") as err:
        load_checkpoint(run)
    assert "kev convert" in str(err.value) and "KEV_ADAPTER" in str(err.value)


def test_head_pt_without_head_safetensors_points_to_convert(flat_copy):
    (flat_copy / "head.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="kev convert"):
        load_checkpoint(flat_copy, require_head=True)


# ---- model ids: one rule, checked before any weight is read ----


def _weights_never_read(monkeypatch):
    import kev.model.checkpoint as checkpoint

    def boom(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(checkpoint, "read_weights", boom)


@pytest.mark.parametrize("bad", ["kev@node", "{kev}", "a:b", "has space", "-lead", "x" * 129, "é", 7, None])
def test_bad_model_id_in_kev_json_is_refused_before_weights(flat_copy, monkeypatch, bad):
    (flat_copy / "kev.json").write_text(json.dumps({"model_id": bad}))
    _weights_never_read(monkeypatch)
    with pytest.raises(CheckpointError, match="kev.json: 'model_id': model id") as err:
        load_checkpoint(flat_copy)
    assert "'{', '}', '@' and ':'" in str(err.value)


@pytest.mark.parametrize("name,want", [("run@v2{x}", "run-v2-x"), ("Qwen3.5 4B kev", "Qwen3.5-4B-kev"),
                                       ("@lead", "lead"), ("ok_name-1.0", "ok_name-1.0")])
def test_directory_name_is_sanitised(flat, tmp_path, caplog, name, want):
    from kev.model.checkpoint import resolve_model_id

    ckpt = Path(shutil.copytree(flat[0], tmp_path / name))
    with caplog.at_level("WARNING", logger="kev.model.checkpoint"):
        assert resolve_model_id(ckpt) == want == load_checkpoint(ckpt).meta.model_id
    assert (f"sanitised to {want!r}" in caplog.text) == (name != want)


def test_unusable_directory_name_is_refused_before_weights(flat, tmp_path, monkeypatch):
    ckpt = Path(shutil.copytree(flat[0], tmp_path / "@{}"))
    _weights_never_read(monkeypatch)
    with pytest.raises(CheckpointError, match="no usable model id"):
        load_checkpoint(ckpt)
    (ckpt / "kev.json").write_text(json.dumps({"model_id": "fine"}))
    monkeypatch.undo()
    assert load_checkpoint(ckpt).meta.model_id == "fine"


def test_check_model_id():
    from kev.model.checkpoint import check_model_id

    assert check_model_id("Qwen/Qwen3.5-4B+kev_1.0") == "Qwen/Qwen3.5-4B+kev_1.0"
    with pytest.raises(CheckpointError, match="KEV_MODEL: model id 'a@b'"):
        check_model_id("a@b", "KEV_MODEL")


# ---- PEFT parts serving never runs: ignored, with a log line ----


def test_modules_to_save_lm_head_is_ignored_with_a_log_line(flat, tmp_path, caplog):
    adapter = make_lora_adapter(tmp_path / "lora", flat[0])
    plain = load_checkpoint(flat[0], adapter).weights
    _edit_json(adapter / "adapter_config.json", lambda r: r.update(modules_to_save=["lm_head"]))
    # PEFT saves a modules_to_save copy under the module's own name.
    _edit_tensors(adapter / "adapter_model.safetensors",
                  lambda t: t.update({"base_model.model.lm_head.weight": torch.ones(300, 64)}))
    with caplog.at_level("INFO", logger="kev.model.lora"):
        got = load_checkpoint(flat[0], adapter).weights
    assert all(torch.equal(got[k], plain[k]) for k in plain)
    assert "modules_to_save ['lm_head'] ignored" in caplog.text
    assert "base_model.model.lm_head.weight" in caplog.text


@pytest.mark.parametrize("saved", [["embed_tokens"], ["lm_head", "score"]])
def test_other_modules_to_save_are_refused(flat, tmp_path, saved):
    adapter = make_lora_adapter(tmp_path / "lora", flat[0])
    _edit_json(adapter / "adapter_config.json", lambda r: r.update(modules_to_save=saved))
    with pytest.raises(CheckpointError, match="modules_to_save") as err:
        load_checkpoint(flat[0], adapter)
    assert "adapter_config.json" in str(err.value) and repr(saved[-1]) in str(err.value)


def test_vision_targets_are_ignored_with_a_log_line(tmp_path, caplog):
    path, _ = make_hf_checkpoint(tmp_path / "base", nested=True)
    adapter = make_lora_adapter(tmp_path / "lora", path)
    plain = load_checkpoint(path, adapter).weights
    vision = ["qkv", "proj", "linear_fc1", "linear_fc2", "model.visual.merger.linear_fc2"]
    _edit_json(adapter / "adapter_config.json", lambda r: r["target_modules"].extend(vision))
    _edit_tensors(adapter / "adapter_model.safetensors", lambda t: t.update({
        "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.ones(4, 32),
        "base_model.model.model.visual.blocks.0.attn.qkv.lora_B.weight": torch.ones(96, 4),
    }))
    with caplog.at_level("INFO", logger="kev.model.lora"):
        got = load_checkpoint(path, adapter).weights
    assert all(torch.equal(got[k], plain[k]) for k in plain)
    assert "vision-tower targets" in caplog.text and "'qkv'" in caplog.text
    assert "model.visual.blocks.0.attn.qkv.lora_A.weight" in caplog.text
