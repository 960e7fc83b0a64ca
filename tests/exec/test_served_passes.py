"""The services' passes on CPU (kev/exec/passes.py): the plain Passes path unchanged, the settings of the
CUDA-graph plan, the row worker's capture-when-idle decision, and the graph metrics.

The CUDA side (warm-up, start-up capture, bitwise replays, no autotune after start-up) is in
tests/exec/test_served_passes_gpu.py.
"""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest

from bank_service.config import BankConfig
from bank_service.config import ConfigError as BankConfigError
from kev.bank.bank import Bank
from kev.ops import get_ops
from kev.ops.shapes import ShapeClass
from kev.exec.plan import DEFAULT_ROW_BUCKETS, PICKS_PER_ROW, GraphPlan, PassRole, parse_doc_buckets, parse_row_buckets, parse_warm_classes
from kev.exec.passes import PassBuilder
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from random_models import random_model, tiny_config
from scorer_service.batcher import RowBatcher
from scorer_service.config import ConfigError, ScorerConfig
from scorer_service.metrics import ScorerMetrics

SCORER_ENV = {"KEV_CHECKPOINT": "/ckpt", "KEV_REDIS_URL": "redis://localhost:6379/0", "KEV_DEVICE": "cuda"}
BANK_ENV = {**SCORER_ENV, "KEV_BANK_MEMORY_BYTES": "1000000"}


# ---- settings -------------------------------------------------------------------------------------

def test_bucket_lists_parse():
    assert parse_row_buckets("8x32, 16X64x100") == ((8, 32, 8 * PICKS_PER_ROW), (16, 64, 100))
    assert parse_doc_buckets("1x64,2x2048") == ((1, 64), (2, 2048))
    assert parse_row_buckets("none") == parse_doc_buckets(" None ") == ()
    assert len(parse_row_buckets(DEFAULT_ROW_BUCKETS)) == 16
    for bad in ("8", "8x", "8x32x4x2", "0x32", "ax32", "8x32,", ""):
        with pytest.raises(ValueError, match="row buckets"):
            parse_row_buckets(bad)
    with pytest.raises(ValueError, match="document buckets"):
        parse_doc_buckets("1x64x8")


def test_warm_classes_parse():
    assert parse_warm_classes("all") is None and parse_warm_classes(" ALL ") is None and parse_warm_classes("") is None
    assert parse_warm_classes("none") == parse_warm_classes(" None") == ()
    # ShapeClass order, once each, whatever the order written
    assert parse_warm_classes("docs_wide, rows_few,docs_wide") == (ShapeClass.ROWS_FEW, ShapeClass.DOCS_WIDE)
    assert parse_warm_classes("rows_few,rows_mid,rows_wide,docs_few,docs_wide") == tuple(ShapeClass)
    for bad in ("rows_small", "rows_few,", "rows_few,all", "none,rows_few"):
        with pytest.raises(ValueError, match=r"unknown autotune class.*known: rows_few, rows_mid, rows_wide, "
                                             r"docs_few, docs_wide"):
            parse_warm_classes(bad)
    with pytest.raises(ValueError, match="ShapeClass"):
        GraphPlan(warm=("rows_few",))


def test_warm_classes_follow_the_plan():
    rows_only = [ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID, ShapeClass.ROWS_WIDE]
    # no `warm`: the role's classes, as before
    assert PassBuilder(None, None, PassRole.ROWS).warm_classes == rows_only
    assert PassBuilder(None, None, PassRole.STATES).warm_classes == list(ShapeClass)
    assert PassBuilder(None, None, PassRole.BOTH).warm_classes == list(ShapeClass)
    plan = GraphPlan(warm=(ShapeClass.DOCS_FEW, ShapeClass.ROWS_FEW, ShapeClass.DOCS_FEW))
    for role in PassRole:  # the plan's, in ShapeClass order and once each, whatever the role
        assert PassBuilder(None, None, role, plan).warm_classes == [ShapeClass.ROWS_FEW, ShapeClass.DOCS_FEW]
    assert PassBuilder(None, None, PassRole.STATES, GraphPlan(warm=())).warm_classes == []


@pytest.mark.parametrize("warm", [None, (ShapeClass.DOCS_FEW,), ()], ids=["role", "some", "none"])
def test_build_warms_the_plan_classes_once(monkeypatch, warm):
    """The CUDA path's warm-up, with the tuner, the runner and `warm_up` stubbed: the classes given,
    once per process (an empty plan too: a re-attach does not warm again)."""
    import kev.exec.passes as passes_module

    calls = []
    monkeypatch.setattr(passes_module, "_indexed", lambda ops: True)
    monkeypatch.setattr(passes_module, "serving_tuner", lambda: "tuner")
    monkeypatch.setattr(passes_module, "Passes", lambda *a, **k: SimpleNamespace(device="cuda"))
    monkeypatch.setattr(passes_module, "warm_up", lambda runner, classes: calls.append(list(classes)) or list(classes))
    bank = SimpleNamespace(block_table=SimpleNamespace(device=torch.device("cuda")))
    builder = PassBuilder(None, None, PassRole.STATES, GraphPlan(max_graphs=0, warm=warm))
    builder.build(bank)
    builder.build(bank, capture=False)
    expected = list(ShapeClass) if warm is None else list(warm)
    assert calls == [expected] and builder.warmed == expected


def test_scorer_graph_settings_from_env_and_flags():
    default = ScorerConfig.from_env(SCORER_ENV, [])
    assert default.graph_plan == GraphPlan(rows=parse_row_buckets(DEFAULT_ROW_BUCKETS), docs=(), max_graphs=32,
                                           max_rows_per_pass=96)
    env = {**SCORER_ENV, "KEV_GRAPH_ROWS": "4x32,8x64x16", "KEV_MAX_GRAPHS": "5", "KEV_MAX_ROWS_PER_PASS": "8"}
    got = ScorerConfig.from_env(env, []).graph_plan
    assert got == GraphPlan(rows=((4, 32, 20), (8, 64, 16)), docs=(), max_graphs=5, max_rows_per_pass=8)
    flagged = ScorerConfig.from_env(env, ["--graph-rows", "none", "--max-graphs", "0"])  # flags override
    assert flagged.graph_plan.rows == () and flagged.graph_plan.max_graphs == 0
    assert ScorerConfig.from_env(SCORER_ENV, []).redacted()["graph_rows"] == DEFAULT_ROW_BUCKETS  # logged


def test_scorer_warm_classes_from_env_and_flags():
    default = ScorerConfig.from_env(SCORER_ENV, [])
    assert default.warm_classes == "all" and default.graph_plan.warm is None
    assert ScorerConfig.from_env({**SCORER_ENV, "KEV_WARM_CLASSES": ""}, []).graph_plan.warm is None  # unset
    env = {**SCORER_ENV, "KEV_WARM_CLASSES": "rows_mid,rows_few"}
    assert ScorerConfig.from_env(env, []).graph_plan.warm == (ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID)
    assert ScorerConfig.from_env(env, ["--warm-classes", "none"]).graph_plan.warm == ()  # the flag overrides
    assert ScorerConfig.from_env(env, []).redacted()["warm_classes"] == "rows_mid,rows_few"  # logged
    with pytest.raises(ConfigError, match="KEV_WARM_CLASSES: unknown autotune class"):
        ScorerConfig.from_env({**SCORER_ENV, "KEV_WARM_CLASSES": "rows"}, [])


@pytest.mark.parametrize("env,match", [
    ({"KEV_GRAPH_ROWS": "8by32"}, "KEV_GRAPH_ROWS"),
    ({"KEV_MAX_GRAPHS": "-1"}, "KEV_MAX_GRAPHS"),
    ({"KEV_MAX_GRAPHS": "many"}, "KEV_MAX_GRAPHS"),
    ({"KEV_GRAPH_ROWS": "1x32,2x32,4x32", "KEV_MAX_GRAPHS": "2"}, "more than KEV_MAX_GRAPHS"),
], ids=["bad-bucket", "negative", "not-a-number", "more-than-kept"])
def test_scorer_bad_graph_settings(env, match):
    with pytest.raises(ConfigError, match=match):
        ScorerConfig.from_env({**SCORER_ENV, **env}, [])


def test_switch_interval_flag_in_both_services():
    assert ScorerConfig.from_env(SCORER_ENV, []).switch_interval_ms == 0  # CPython's own
    assert ScorerConfig.from_env(SCORER_ENV, ["--switch-interval-ms", "0.5"]).switch_interval_ms == 0.5
    assert BankConfig.from_env(BANK_ENV, []).switch_interval_ms == 0
    assert BankConfig.from_env(BANK_ENV, ["--switch-interval-ms", "0.25"]).switch_interval_ms == 0.25
    with pytest.raises(ConfigError, match="--switch-interval-ms must be >= 0"):
        ScorerConfig.from_env(SCORER_ENV, ["--switch-interval-ms", "-1"])
    with pytest.raises(BankConfigError, match="--switch-interval-ms must be >= 0"):
        BankConfig.from_env(BANK_ENV, ["--switch-interval-ms", "-1"])


def test_bank_graph_settings_from_env_and_flags():
    default = BankConfig.from_env(BANK_ENV, [])
    assert default.graph_plan == GraphPlan(rows=(), docs=parse_doc_buckets(
        "1x48,2x48,4x48,8x48,16x48,32x48,64x48,1x256,1x1024,1x2208,2x2208,4x2208,6x2208"), max_graphs=24)
    assert default.ops_backend == "triton" and default.redacted()["ops_backend"] == "triton"
    assert BankConfig.from_env({**BANK_ENV, "KEV_DEVICE": "cpu"}, []).ops_backend == "torch"
    assert BankConfig.from_env(BANK_ENV, ["--ops", "torch"]).ops_backend == "torch"  # explicit choice wins
    env = {**BANK_ENV, "KEV_GRAPH_DOCS": "2x512", "KEV_MAX_GRAPHS": "3"}
    assert BankConfig.from_env(env, []).graph_plan == GraphPlan(rows=(), docs=((2, 512),), max_graphs=3)
    flagged = BankConfig.from_env(env, ["--graph-docs", "1x64,1x128", "--max-graphs", "0"]).graph_plan
    assert flagged == GraphPlan(rows=(), docs=((1, 64), (1, 128)), max_graphs=0)
    for bad, match in (({"KEV_GRAPH_DOCS": "1x64x3"}, "KEV_GRAPH_DOCS"), ({"KEV_MAX_GRAPHS": "x"}, "KEV_MAX_GRAPHS"),
                       ({"KEV_MAX_GRAPHS": "1"}, "more than KEV_MAX_GRAPHS")):
        with pytest.raises(BankConfigError, match=match):
            BankConfig.from_env({**BANK_ENV, **bad}, [])


def test_bank_warm_classes_from_env_and_flags():
    default = BankConfig.from_env(BANK_ENV, [])
    assert default.warm_classes == "all" and default.graph_plan.warm is None
    env = {**BANK_ENV, "KEV_WARM_CLASSES": "rows_few,docs_few"}
    assert BankConfig.from_env(env, []).graph_plan.warm == (ShapeClass.ROWS_FEW, ShapeClass.DOCS_FEW)
    assert BankConfig.from_env(env, ["--warm-classes", "all"]).graph_plan.warm is None  # the flag overrides
    assert BankConfig.from_env(BANK_ENV, ["--warm-classes", "none"]).graph_plan.warm == ()
    assert BankConfig.from_env(env, []).redacted()["warm_classes"] == "rows_few,docs_few"  # logged
    with pytest.raises(BankConfigError, match="KEV_WARM_CLASSES: unknown autotune class"):
        BankConfig.from_env({**BANK_ENV, "KEV_WARM_CLASSES": "docs"}, [])


def test_start_keys_follow_the_plan():
    from kev.exec.graphs import Buckets
    from kev.exec.static_pass import GraphKey, PassKind

    buckets = Buckets(rows=(1, 2, 4, 8, 16, 32, 64, 96, 128))  # powers of two: 3 rows pad to 4, 7 to 8
    plan = GraphPlan(rows=((3, 20, 20), (4, 32, 20), (8, 64, 40), (128, 32, 640)), docs=((1, 100), (3, 2048)),
                     max_graphs=8, max_rows_per_pass=7)
    rows = PassBuilder(None, None, PassRole.ROWS, plan).start_keys(buckets)
    # 3x20 and 4x32 are one bucket; 8 rows is the bucket of 7; 128 rows is beyond it: skipped
    assert rows == [GraphKey(PassKind.ROWS, 4, 32, 32), GraphKey(PassKind.ROWS, 8, 64, 64)]
    states = PassBuilder(None, None, PassRole.STATES, plan).start_keys(buckets)
    assert states == [GraphKey(PassKind.STATE, 1, 128), GraphKey(PassKind.STATE, 4, 2048)]
    assert len(PassBuilder(None, None, PassRole.BOTH, plan).start_keys(buckets)) == 4
    with pytest.raises(ValueError, match="beyond the graph buckets"):
        PassBuilder(None, None, PassRole.ROWS, GraphPlan(rows=((4, 200, 8),))).start_keys(buckets)
    with pytest.raises(ValueError, match="at most 1 are kept"):
        PassBuilder(None, None, PassRole.STATES, GraphPlan(docs=((1, 64), (1, 128)), max_graphs=1)).start_keys(buckets)


def test_default_doc_buckets_all_exist():
    from kev.exec.graphs import Buckets

    keys = PassBuilder(None, None, PassRole.STATES, BankConfig.from_env(BANK_ENV, []).graph_plan).start_keys(Buckets())
    assert len(keys) == 13 and max(k.num_tokens for k in keys) <= Buckets().max_state_tokens
    with pytest.raises(ValueError, match="beyond the graph buckets"):  # 8 x 2,304 > 16,384 tokens
        PassBuilder(None, None, PassRole.STATES, GraphPlan(docs=((8, 2200),))).start_keys(Buckets())


def test_gathered_scorer_caps_its_document_limit():
    gathered = ScorerConfig.from_env({**SCORER_ENV, "KEV_OPS": "gathered",
                                      "KEV_GATHERED_MAX_PREFIX_TOKENS": "2200"}, [])
    assert gathered.gathered_max_prefix_tokens == 2200 and gathered.limits.max_document_tokens == 2200
    assert gathered.redacted()["document_limit"] == 2200
    default = ScorerConfig.from_env({**SCORER_ENV, "KEV_OPS": "gathered"}, [])
    assert default.limits.max_document_tokens == 4096
    indexed = ScorerConfig.from_env({**SCORER_ENV, "KEV_GATHERED_MAX_PREFIX_TOKENS": "2200"}, [])
    assert indexed.limits.max_document_tokens == 65536  # only the gathered ops are capped
    with pytest.raises(ConfigError, match="gathered_max_prefix_tokens"):
        ScorerConfig.from_env({**SCORER_ENV, "KEV_OPS": "gathered", "KEV_GATHERED_MAX_PREFIX_TOKENS": "0"}, [])


# ---- the CPU path: a plain Passes --------------------------------------------------------------

@pytest.mark.parametrize("role", list(PassRole))
def test_cpu_builds_a_plain_runner(role):
    cfg = tiny_config()
    model = random_model(cfg, seed=3)
    bank = Bank.allocate(cfg, num_slots=4, num_blocks=16, block_size=64, max_doc_tokens=256)
    builder = PassBuilder(model, get_ops("torch"), role)
    passes = builder.build(bank)
    assert passes.graphs is None and passes.tuner is None and builder.tuner is None
    assert builder.graph_stats is None and builder.warmed == []
    assert not passes.idle_work and passes.capture_when_idle() == 0
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(0, cfg.vocab_size, (70,), generator=g).tolist()
    a, b = bank.alloc(70), bank.alloc(70)
    passes.state_pass([doc], [a])
    Passes(model, bank, get_ops("torch")).state_pass([doc], [b])
    for pool in bank.pools.recurrent + bank.pools.conv:
        assert torch.equal(pool[a.slot], pool[b.slot])
    rows = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9)]
    batch = RowBatch.build(rows, [a, b], [70, 70], [[4], [2, 8]])
    assert torch.equal(passes.row_pass(batch), Passes(model, bank, get_ops("torch")).row_pass(batch))


# ---- the row worker captures only when its queue is empty ---------------------------------------

class FakePasses:
    """Stands in for `Passes`: graphs waiting to be captured, and a record of when."""

    def __init__(self):
        self.pending = 0
        self.batcher = None
        self.events = []  # ("capture", queue depth) / ("pass", rows)

    @property
    def idle_work(self) -> bool:
        return self.pending > 0

    def capture_when_idle(self, limit: int = 1) -> int:
        self.events.append(("capture", self.batcher.depth))
        self.pending -= 1
        return 1


def prepared(n_rows: int):
    return SimpleNamespace(rows=[SimpleNamespace(prompt=SimpleNamespace(ids=[1, 2, 3]))] * n_rows)


def wait_until(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def worker(monkeypatch):
    """A RowBatcher whose passes are recorded (and held at `gate` at launch) instead of run;
    `passes.order` records launches and answer reads in the order the worker made them."""
    passes = FakePasses()
    passes.order = []
    gate, running = threading.Event(), threading.Event()

    def fake_launch(self, rows):
        passes.events.append(("pass", len(rows)))
        passes.order.append(("launch", len(passes.order)))
        running.set()
        assert gate.wait(10)
        return passes.order[-1][1]  # stands in for the launched pass

    def fake_finish(self, launched):
        passes.order.append(("finish", launched))

    monkeypatch.setattr(RowBatcher, "_launch", fake_launch)
    monkeypatch.setattr(RowBatcher, "_finish", fake_finish)

    def make(max_wait_ms):
        link = SimpleNamespace(current=SimpleNamespace(passes=passes))
        batcher = RowBatcher(link, None, ScorerMetrics(), max_rows_per_pass=2, max_tokens_per_pass=1000,
                             max_wait_ms=max_wait_ms, max_queue=100)
        passes.batcher = batcher
        return batcher, passes, gate, running

    made = []

    def start(max_wait_ms=0):
        made.append(make(max_wait_ms))
        return made[-1]

    yield start
    gate.set()
    for batcher, *_ in made:
        batcher.stop(5)


def test_no_capture_while_rows_are_queued(worker):
    batcher, passes, gate, running = worker()
    batcher.submit(prepared(2), lease=None)
    assert running.wait(5)  # the first pass is running, held at the gate
    passes.pending = 3  # graphs queued (e.g. buckets used twice) while the server is busy
    batcher.submit(prepared(4), lease=None)  # two more passes' worth
    time.sleep(0.05)
    gate.set()
    wait_until(lambda: passes.pending == 0, "the idle captures")
    assert passes.events == [("pass", 2), ("pass", 2), ("pass", 2)] + [("capture", 0)] * 3


def test_no_capture_while_a_row_waits_for_companions(worker):
    batcher, passes, gate, running = worker(max_wait_ms=300)
    gate.set()
    passes.pending = 1  # the worker sleeps until a row comes
    batcher.submit(prepared(1), lease=None)  # not a full pass: it waits up to 300 ms for more rows
    time.sleep(0.1)
    assert passes.events == [], "captured while a row was waiting"
    wait_until(lambda: passes.pending == 0, "the capture after the pass")
    assert passes.events == [("pass", 1), ("capture", 0)]


def test_next_pass_is_launched_before_the_last_ones_answers_are_read(worker):
    """Rows for two passes waiting: pass 2 goes to the GPU before the worker waits for pass 1's
    answers; with nothing more ready, pass 2's answers are read next (no pass is left behind)."""
    batcher, passes, gate, running = worker()
    gate.set()
    batcher.submit(prepared(4), lease=None)  # two full passes (2 rows each) at once
    wait_until(lambda: len(passes.order) == 4, "two passes launched and read")
    assert passes.order == [("launch", 0), ("launch", 1), ("finish", 0), ("finish", 1)]
    batcher.submit(prepared(1), lease=None)  # alone: launched and read before anything else
    wait_until(lambda: len(passes.order) == 6, "the third pass")
    assert passes.order[4:] == [("launch", 4), ("finish", 4)]


# ---- metrics ------------------------------------------------------------------------------------

def test_graph_metrics():
    metrics, stats = ScorerMetrics(), SimpleNamespace(replays=7, eager_bucketed=2, unbucketed=1, captures=5)
    metrics.watch_graphs(lambda: stats)
    text = generate_latest(metrics.registry).decode()
    assert 'kev_scorer_graph_passes_total{path="replay"} 7.0' in text
    assert 'kev_scorer_graph_passes_total{path="eager_bucketed"} 2.0' in text
    assert 'kev_scorer_graph_passes_total{path="unbucketed"} 1.0' in text
    assert "kev_scorer_graph_captures_total 5.0" in text
    stats.replays = 9  # read at scrape time
    assert 'path="replay"} 9.0' in generate_latest(metrics.registry).decode()
    on_cpu = ScorerMetrics()
    on_cpu.watch_graphs(lambda: None)
    assert "kev_scorer_graph" not in generate_latest(on_cpu.registry).decode()
