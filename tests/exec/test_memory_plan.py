"""The start-up memory plan (`kev.exec.memory.memory_plan`) on CPU: its parts for every Kev size,
the one-copy-of-the-weights arithmetic of issue 28 on an H100 80GB, the refusal message, and the
two services refusing a plan that cannot fit before they read any weight (the device's memory
faked; on CPU nothing is checked)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from kev.exec.memory import (GB, PROCESS_OVERHEAD_BYTES, MemoryPlanError, check_memory_plan, memory_plan,
                             pass_peak_bytes, state_pass_peak_bytes, weight_bytes)
from kev.exec.plan import GraphPlan, PassRole
from kev.model.qwen35 import Qwen35Model
from random_models import tiny_config

try:  # `python -m pytest` from the repo root has it on sys.path; a bare `pytest` may not
    import bench  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import KEV_MODELS, kev_config  # noqa: E402
from bench.memory_budget import DEVICES, largest_bank, pod_plan  # noqa: E402

H100 = DEVICES["H100 80GB"]


@pytest.mark.parametrize("model", list(KEV_MODELS))
def test_every_kev_size_plans_weights_bank_workspaces_graphs(model):
    cfg = kev_config(model)
    bank = memory_plan(cfg, PassRole.STATES, GraphPlan(), bank_bytes=12 * GB)
    scorer = memory_plan(cfg, PassRole.ROWS, GraphPlan())
    shared = memory_plan(cfg, PassRole.ROWS, GraphPlan(), weights_shared=True)
    # the weights as served: embedding once (no LM head), every other parameter, bf16
    embedding = cfg.vocab_size * cfg.hidden_size
    assert 2 * (cfg.non_embedding_params() + embedding) <= weight_bytes(cfg) <= 2.01 * (cfg.non_embedding_params()
                                                                                         + embedding)
    assert bank.part("weights") == scorer.part("weights") == weight_bytes(cfg) and shared.part("weights") == 0
    assert bank.part("bank") == 12 * GB and scorer.part("bank") == 0
    # the bank's largest state pass (16,384 tokens of 64 documents) and the scorer's row pass
    # (8,192 tokens of 96 rows), each as an eager workspace and again as the graph pool's largest key
    assert bank.part("pass workspace") == state_pass_peak_bytes(cfg, 16384, 64)
    assert scorer.part("pass workspace") == state_pass_peak_bytes(cfg, 8192, 96)
    assert bank.part("CUDA-graph pool") > bank.part("pass workspace")  # the top key's C exceeds the pass's chunks
    assert scorer.part("CUDA-graph pool") < 1.2 * scorer.part("pass workspace")
    assert bank.part("CUDA context and kernels") == PROCESS_OVERHEAD_BYTES
    assert shared.total_bytes == scorer.total_bytes - weight_bytes(cfg)
    no_graphs = memory_plan(cfg, PassRole.STATES, GraphPlan(cuda_graphs=False), bank_bytes=12 * GB)
    assert no_graphs.total_bytes == bank.total_bytes - bank.part("CUDA-graph pool")
    assert bank.describe().startswith(f"weights {weight_bytes(cfg) / GB:.2f} GB + bank 12.00 GB + pass workspace")


def test_kev_27b_fits_an_h100_with_one_copy_of_the_weights_not_two():
    cfg = kev_config("kev-27b")
    assert 51 * GB <= weight_bytes(cfg) <= 55 * GB
    one = pod_plan(cfg, 12 * GB)  # the bank's weights, mapped by the scorer
    two = pod_plan(cfg, 12 * GB, weights_shared=False)
    assert one.fits(H100) and not two.fits(H100)
    assert two.total_bytes - one.total_bytes == weight_bytes(cfg)
    assert largest_bank(cfg, H100) >= 12 * GB
    assert largest_bank(cfg, H100, weights_shared=False) == 0


def test_kev_4b_bank_grows_by_the_weights_it_no_longer_duplicates():
    cfg = kev_config("kev-4b")
    grown = largest_bank(cfg, H100) - largest_bank(cfg, H100, weights_shared=False)
    assert weight_bytes(cfg) - (1 << 30) < grown <= weight_bytes(cfg) + (1 << 30)  # whole GiB either way


def test_split_mode_workspace_only_for_few_tokens():
    cfg = kev_config("kev-4b")
    assert pass_peak_bytes(cfg, 256, 4) > state_pass_peak_bytes(cfg, 256, 4)
    assert pass_peak_bytes(cfg, 257, 4) == state_pass_peak_bytes(cfg, 257, 4)
    # a small scorer cap: its whole ladder is rows_few, so the split workspace is planned
    small = memory_plan(cfg, PassRole.ROWS, GraphPlan(row_tokens=256, row_seqs=8, warm=()))
    assert small.part("pass workspace") == pass_peak_bytes(cfg, 256, 8)


def test_warm_up_shapes_beyond_the_caps_are_planned():
    """A bank capped at 1,024 tokens per pass still runs one long document's 8,192-token chunk
    alone, and warms docs_few on 4,096-token documents."""
    cfg = kev_config("kev-9b")
    capped = memory_plan(cfg, PassRole.STATES, GraphPlan(state_tokens=1024, state_seqs=8))
    assert capped.part("pass workspace") == state_pass_peak_bytes(cfg, 8192, 8)


def test_weight_bytes_are_the_models_parameters():
    cfg = tiny_config(hv_per_h=3)
    model = Qwen35Model(cfg)
    assert weight_bytes(cfg, torch.float32) == sum(p.numel() for p in model.parameters()) * 4


def test_refusal_names_every_part_the_total_and_the_device():
    cfg = kev_config("kev-27b")
    plan = memory_plan(cfg, PassRole.STATES, GraphPlan(), bank_bytes=40 * GB)
    with pytest.raises(MemoryPlanError) as e:
        plan.check(H100, "cuda:0")
    msg = str(e.value)
    for name, n in plan.parts:
        assert f"{name} {n / GB:.2f} GB" in msg
    assert f"= {plan.total_bytes / GB:.2f} GB" in msg and f"cuda:0 has {H100 / GB:.2f} GB" in msg
    assert "KEV_BANK_MEMORY_BYTES" in msg
    plan.check(plan.total_bytes, "cuda:0")  # exactly full fits


def fake_gpu(monkeypatch, free: int, reserved: int = 0):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 200 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def test_check_counts_free_memory_and_what_this_process_holds(monkeypatch):
    plan = memory_plan(kev_config("kev-4b"), PassRole.ROWS, GraphPlan(), weights_shared=True)
    assert check_memory_plan(plan, "cpu") is plan  # nothing checked off CUDA
    fake_gpu(monkeypatch, plan.total_bytes - GB, reserved=GB)
    check_memory_plan(plan, "cuda")
    fake_gpu(monkeypatch, plan.total_bytes - GB)
    with pytest.raises(MemoryPlanError, match="scorer's memory plan does not fit cuda"):
        check_memory_plan(plan, "cuda")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tiny_stack import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "kev-tiny")


def test_scorer_refuses_before_loading(monkeypatch, checkpoint, caplog):
    from scorer_service import __main__ as scorer_main

    monkeypatch.setattr("kev.exec.memory.device_memory_bytes", lambda device: GB // 10)
    monkeypatch.setattr(scorer_main.LoadedModel, "load", lambda *a, **k: pytest.fail("loaded despite the plan"))
    env = {"KEV_CHECKPOINT": str(checkpoint), "KEV_REDIS_URL": "redis://127.0.0.1:1", "KEV_DEVICE": "cuda"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.ERROR, logger="scorer_service"):
        assert scorer_main.main([]) == 2
    assert "scorer's memory plan does not fit cuda" in caplog.text and "0.10 GB" in caplog.text


def test_bank_refuses_before_loading(monkeypatch, checkpoint):
    from bank_service import server
    from bank_service.config import BankConfig

    monkeypatch.setattr("kev.exec.memory.device_memory_bytes", lambda device: GB // 10)
    monkeypatch.setattr(server.LoadedModel, "load", lambda *a, **k: pytest.fail("loaded despite the plan"))
    config = BankConfig.from_env({"KEV_CHECKPOINT": str(checkpoint), "KEV_REDIS_URL": "redis://127.0.0.1:1",
                                  "KEV_DEVICE": "cuda", "KEV_BANK_MEMORY_BYTES": str(2 * GB),
                                  "KEV_BANK_LISTEN": "127.0.0.1:0", "KEV_METRICS_PORT": "0"})
    service = server.BankService(config)
    try:
        with pytest.raises(MemoryPlanError, match=r"bank's memory plan does not fit cuda: .*bank 2\.00 GB"):
            service.start()
    finally:
        service.stop()


def test_service_defaults_are_the_plans_defaults():
    """bench/memory_budget.py plans GraphPlan()'s caps: they are the services' default pass caps."""
    from bank_service.config import BankConfig
    from scorer_service.config import ScorerConfig

    bank = BankConfig.from_env({"KEV_CHECKPOINT": "x", "KEV_REDIS_URL": "redis://h", "KEV_DEVICE": "cuda",
                                "KEV_BANK_MEMORY_BYTES": "1"})
    scorer = ScorerConfig.from_env({"KEV_CHECKPOINT": "x", "KEV_REDIS_URL": "redis://h", "KEV_DEVICE": "cuda"}, [])
    from bench.memory_budget import BANK_GRAPHS, BANK_ROLE

    plan = GraphPlan()
    assert (bank.graph_plan.state_tokens, bank.graph_plan.state_seqs) == (plan.state_tokens, plan.state_seqs)
    assert bank.graph_plan == BANK_GRAPHS and bank.pass_role is BANK_ROLE  # with its idle sweeps' row keys
    assert (scorer.graph_plan.row_tokens, scorer.graph_plan.row_seqs) == (plan.row_tokens, plan.row_seqs)
    assert bank.graph_plan.cuda_graphs and scorer.graph_plan.cuda_graphs
