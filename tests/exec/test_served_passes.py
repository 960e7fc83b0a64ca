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
from kev.exec.graphs import GraphCache, GraphStats, KeyLadder
from kev.exec.plan import GraphPlan, PassRole, parse_warm_classes
from kev.exec.static_pass import PassKind, StaticPass
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


@pytest.mark.parametrize("cap", ["row_tokens", "row_seqs", "state_tokens", "state_seqs"])
def test_graph_plan_caps_are_positive(cap):
    with pytest.raises(ValueError, match=f"{cap} must be >= 1, got 0"):
        GraphPlan(**{cap: 0})


def test_warm_classes_follow_the_plan():
    """No `warm`: the classes of the role's keys (ShapeClass order), from the plan's caps."""
    rows_only = [ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID, ShapeClass.ROWS_WIDE]
    assert PassBuilder(None, None, PassRole.ROWS).warm_classes == rows_only
    # state keys of <= 256 tokens are rows_few
    assert PassBuilder(None, None, PassRole.STATES).warm_classes == [ShapeClass.ROWS_FEW, ShapeClass.DOCS_FEW,
                                                                     ShapeClass.DOCS_WIDE]
    assert PassBuilder(None, None, PassRole.BOTH).warm_classes == list(ShapeClass)
    for role in PassRole:  # exactly the classes of the role's keys
        builder = PassBuilder(None, None, role)
        used = {k.shape_class for ladder in builder.ladders() if ladder is not None for k in ladder.keys()}
        assert builder.warm_classes == [c for c in ShapeClass if c in used]
    small = GraphPlan(row_tokens=256, state_tokens=4096)  # smaller caps: fewer classes
    assert PassBuilder(None, None, PassRole.ROWS, small).warm_classes == [ShapeClass.ROWS_FEW]
    assert PassBuilder(None, None, PassRole.STATES, small).warm_classes == [ShapeClass.ROWS_FEW, ShapeClass.DOCS_FEW]
    mid = GraphPlan(row_tokens=1024, cuda_graphs=False)  # graphs off: the classes the keys would have
    assert PassBuilder(None, None, PassRole.ROWS, mid).warm_classes == rows_only[:2]
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
    builder = PassBuilder("model", None, PassRole.STATES, GraphPlan(cuda_graphs=False, warm=warm))
    builder.build(bank)
    builder.build(bank, capture=False)
    expected = [ShapeClass.ROWS_FEW, ShapeClass.DOCS_FEW, ShapeClass.DOCS_WIDE] if warm is None else list(warm)
    assert calls == [expected] and builder.warmed == expected


def test_scorer_graph_settings_from_env_and_flags():
    """The scorer's keys cover its own row-pass caps; KEV_CUDA_GRAPHS (or --cuda-graphs) turns them off."""
    default = ScorerConfig.from_env(SCORER_ENV, [])
    assert default.graph_plan == GraphPlan(cuda_graphs=True, row_tokens=8192, row_seqs=96)
    assert (default.graph_plan.row_tokens, default.graph_plan.row_seqs) == (default.max_tokens_per_pass,
                                                                           default.max_rows_per_pass)
    env = {**SCORER_ENV, "KEV_MAX_TOKENS_PER_PASS": "2048", "KEV_MAX_ROWS_PER_PASS": "8", "KEV_CUDA_GRAPHS": "0"}
    got = ScorerConfig.from_env(env, []).graph_plan
    assert got == GraphPlan(cuda_graphs=False, row_tokens=2048, row_seqs=8)
    flagged = ScorerConfig.from_env(env, ["--cuda-graphs", "on", "--max-rows-per-pass", "4"])  # flags override
    assert flagged.graph_plan == GraphPlan(cuda_graphs=True, row_tokens=2048, row_seqs=4)
    assert ScorerConfig.from_env(env, []).redacted()["cuda_graphs"] is False  # logged
    assert default.redacted()["cuda_graphs"] is True


@pytest.mark.parametrize("raw,value", [("1", True), ("on", True), ("TRUE", True), (" Yes ", True),
                                       ("0", False), ("off", False), ("False", False), ("no", False)])
def test_cuda_graphs_setting_in_both_services(raw, value):
    assert ScorerConfig.from_env({**SCORER_ENV, "KEV_CUDA_GRAPHS": raw}, []).graph_plan.cuda_graphs is value
    assert BankConfig.from_env({**BANK_ENV, "KEV_CUDA_GRAPHS": raw}, []).graph_plan.cuda_graphs is value
    assert ScorerConfig.from_env(SCORER_ENV, ["--cuda-graphs", raw]).cuda_graphs is value
    assert BankConfig.from_env(BANK_ENV, ["--cuda-graphs", raw]).cuda_graphs is value


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


@pytest.mark.parametrize("env,argv,match", [
    ({"KEV_CUDA_GRAPHS": "maybe"}, [], "KEV_CUDA_GRAPHS must be one of 1, on, true, yes, 0, off, false, no, "
                                        "got 'maybe'"),
    ({"KEV_CUDA_GRAPHS": "2"}, [], "KEV_CUDA_GRAPHS"),
    ({}, ["--cuda-graphs", "enabled"], "KEV_CUDA_GRAPHS"),  # a flag's bad value names the variable too
    ({"KEV_MAX_TOKENS_PER_PASS": "0"}, [], "max_tokens_per_pass must be >= 1"),
    ({"KEV_MAX_ROWS_PER_PASS": "0"}, [], "max_rows_per_pass must be >= 1"),
], ids=["not-a-bool", "number", "flag", "no-tokens", "no-rows"])
def test_scorer_bad_graph_settings(env, argv, match):
    with pytest.raises(ConfigError, match=match):
        ScorerConfig.from_env({**SCORER_ENV, **env}, argv)


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
    """The bank's keys cover its own state-pass caps, and its idle sweeps' rows (one document and its
    rows); KEV_CUDA_GRAPHS (or --cuda-graphs) turns them off."""
    default = BankConfig.from_env(BANK_ENV, [])
    assert default.graph_plan == GraphPlan(cuda_graphs=True, state_tokens=16384, state_seqs=64, row_tokens=2048,
                                           row_seqs=32, sweep_one_document=True)
    assert default.pass_role is PassRole.BOTH
    no_sweeps = BankConfig.from_env(BANK_ENV, ["--sweep-rows", "0"])
    assert no_sweeps.pass_role is PassRole.STATES and not no_sweeps.graph_plan.sweep_one_document
    assert (default.graph_plan.state_tokens, default.graph_plan.state_seqs) == (default.max_pass_tokens,
                                                                               default.max_pass_documents)
    assert default.ops_backend == "triton" and default.redacted()["ops_backend"] == "triton"
    assert BankConfig.from_env({**BANK_ENV, "KEV_DEVICE": "cpu"}, []).ops_backend == "torch"
    assert BankConfig.from_env(BANK_ENV, ["--ops", "torch"]).ops_backend == "torch"  # explicit choice wins
    env = {**BANK_ENV, "KEV_CUDA_GRAPHS": "off"}
    capped = BankConfig.from_env(env, ["--max-pass-tokens", "4096", "--max-pass-documents", "8", "--sweep-row-tokens", "0"])
    assert capped.graph_plan == GraphPlan(cuda_graphs=False, state_tokens=4096, state_seqs=8)
    assert capped.redacted()["cuda_graphs"] is False  # logged
    assert BankConfig.from_env(env, ["--cuda-graphs", "1"]).graph_plan.cuda_graphs is True  # the flag overrides
    for bad, argv in (({"KEV_CUDA_GRAPHS": "sometimes"}, []), ({}, ["--cuda-graphs", "-1"])):
        with pytest.raises(BankConfigError, match="KEV_CUDA_GRAPHS must be one of"):
            BankConfig.from_env({**BANK_ENV, **bad}, argv)


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


def test_ladders_follow_the_plan():
    """A role's ladders (what it captures at start-up): rows for a scorer, states for the bank,
    both for the engine, their caps the plan's."""
    plan = GraphPlan(row_tokens=512, row_seqs=16, state_tokens=2048, state_seqs=8)
    rows = KeyLadder(PassKind.ROWS, 512, 16)
    states = KeyLadder(PassKind.STATE, 2048, 8)
    assert PassBuilder(None, None, PassRole.ROWS, plan).ladders() == (rows, None)
    assert PassBuilder(None, None, PassRole.STATES, plan).ladders() == (None, states)
    assert PassBuilder(None, None, PassRole.BOTH, plan).ladders() == (rows, states)
    both = GraphCache(*PassBuilder(None, None, PassRole.BOTH, plan).ladders())
    keys = both.all_keys()  # the start-up capture order: largest first, every key once
    assert len(keys) == len(set(keys)) == len(rows.keys()) + len(states.keys())
    assert keys == sorted(keys, key=lambda k: (k.tokens, k.chunks), reverse=True)
    assert keys[0] == max(states.keys(), key=lambda k: (k.tokens, k.chunks))


def test_the_bank_captures_its_state_and_sweep_row_keys_at_start_up(monkeypatch):
    """The bank with idle sweeps captures every key at start-up, its state keys and its sweep rows'
    keys, so no sweep stalls on a capture (docs/decisions.md, "Batch windows"); a sweep whose own
    key has no graph runs as the two captured passes, never eagerly."""
    import kev.exec.passes as passes_module
    from kev.exec.static_pass import SweepKey

    captured = []
    monkeypatch.setattr(passes_module, "_indexed", lambda ops: True)
    monkeypatch.setattr(passes_module, "serving_tuner", lambda: "tuner")
    monkeypatch.setattr(passes_module, "warm_up", lambda runner, classes: list(classes))
    monkeypatch.setattr(passes_module, "Passes", lambda *a, **k: SimpleNamespace(
        device="cuda", with_graphs=lambda graphs: SimpleNamespace(graphs=graphs)))
    monkeypatch.setattr(GraphCache, "capture", lambda self, passes, keys: captured.extend(keys))
    bank = SimpleNamespace(block_table=SimpleNamespace(device=torch.device("cuda")))
    plan = GraphPlan(row_tokens=256, row_seqs=4, state_tokens=1024, state_seqs=4, sweep_one_document=True)
    graphs = PassBuilder("model", None, PassRole.BOTH, plan).build(bank).graphs
    rows, states = KeyLadder(PassKind.ROWS, 256, 4), KeyLadder(PassKind.STATE, 1024, 4)
    assert sorted(captured, key=str) == sorted(rows.keys() + states.keys(), key=str) and not graphs.pending
    state, row = states.key_for([100]), rows.key_for([20, 30])
    assert graphs.sweep_key(state, row) == SweepKey(state, row)  # nothing queued: one sweep (graphed or counted)


@pytest.mark.parametrize("service", ["scorer", "bank"])
def test_default_ladders_cover_the_pass_caps(service):
    """Every pass the service builds under its default pass caps has a key (so none runs outside a
    CUDA graph once start-up has captured them); none beyond the caps."""
    if service == "scorer":
        cfg = ScorerConfig.from_env(SCORER_ENV, [])
        role, tokens, seqs = PassRole.ROWS, cfg.max_tokens_per_pass, cfg.max_rows_per_pass
    else:
        cfg = BankConfig.from_env(BANK_ENV, [])
        role, tokens, seqs = PassRole.STATES, cfg.max_pass_tokens, cfg.max_pass_documents
    builder = PassBuilder(None, None, role, cfg.graph_plan)
    ladder = next(ladder for ladder in builder.ladders() if ladder is not None)
    keys = set(ladder.keys())
    assert max(k.tokens for k in keys) == tokens and min(k.tokens for k in keys) == 16
    assert len(keys) <= 250, "start-up captures every key"
    edges = [[tokens], [1] * seqs, [tokens // seqs] * seqs, [tokens - seqs + 1] + [1] * (seqs - 1),
             [65] * min(seqs, tokens // 65), [1]]
    g = torch.Generator().manual_seed(4)
    passes = []
    for _ in range(300):
        n = int(torch.randint(1, seqs + 1, (1,), generator=g))
        mean = int(torch.randint(1, 2 * tokens // n + 1, (1,), generator=g))
        lens = torch.randint(1, max(2, mean + 1), (n,), generator=g).tolist()
        passes.append(lens)
    for lens in edges + passes:
        key = ladder.key_for(lens)
        if sum(lens) > tokens:
            assert key is None
            continue
        assert key in keys and key.tokens >= sum(lens) and key.chunks > len(lens), lens
        assert StaticPass(key, 4, 16, "cpu").fits(lens)
    assert ladder.key_for([tokens + 1]) is None and ladder.key_for([1] * (seqs + 1)) is None


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


def test_a_document_read_in_pieces_over_passes_equals_one_read():
    """The bank splits a document across state passes at whole delta-rule chunks (`piece_tokens`,
    bank_service/acquire.py): each piece continues the states the last one left in the slot, beside
    other documents' pieces of other starts. On CPU the result is the one pass's, bit for bit: its
    states and what rows read from them (the prefix's K/V included)."""
    cfg = tiny_config()
    model = random_model(cfg, seed=5)
    bank = Bank.allocate(cfg, num_slots=6, num_blocks=32, block_size=64, max_doc_tokens=512)
    passes = Passes(model, bank, get_ops("torch"), state_chunk_tokens=128)
    g = torch.Generator().manual_seed(1)
    long, other = (torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (300, 90))
    whole, split = bank.alloc(300), bank.alloc(300)
    passes.state_pass([long], [whole])  # one call: chunks of 128 (the pass's own rounds)
    assert passes.piece_tokens(300, 100) == 64 and passes.piece_tokens(236, 1000) == 128
    a, b = bank.alloc(90), bank.alloc(90)
    passes.state_pass([long[:64], other], [split, a])  # the first chunk, beside a new document
    passes.state_pass([other, long[64:192]], [b, split], [0, 64])  # the next piece starts at 64
    passes.state_pass([long[192:]], [split], [192])
    for pool in bank.pools.recurrent + bank.pools.conv:
        assert torch.equal(pool[whole.slot], pool[split.slot])
        assert torch.equal(pool[a.slot], pool[b.slot])
    row, other_row = (torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 5))
    batch = RowBatch.build([row, row, other_row], [whole, split, a], [300, 300, 90], [[6], [6], [4]])
    out = passes.row_pass(batch)
    assert torch.equal(out[0], out[1])
    with pytest.raises(ValueError, match="starts"):
        passes.state_pass([other], [b], [0, 0])


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

    def rows_to_take(self, row_lens) -> int:  # no graph keys here: a full pass takes all its rows
        return len(row_lens)

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
    passes.pending = 3  # graphs queued (a re-attach's keys, sweeps used twice) while the server is busy
    batcher.submit(prepared(4), lease=None)  # two more passes' worth
    time.sleep(0.05)
    gate.set()
    wait_until(lambda: passes.pending == 0, "the idle captures")
    assert passes.events == [("pass", 2), ("pass", 2), ("pass", 2)] + [("capture", 0)] * 3


def test_a_lone_row_goes_at_once_and_the_capture_after_it(worker):
    """Nothing in flight: a part-full pass waits for no window (issue 26), and no capture runs
    ahead of it (tests/services/test_idle_batching.py covers the window with a busy device)."""
    batcher, passes, gate, running = worker(max_wait_ms=5000)
    gate.set()
    passes.pending = 1  # the worker sleeps until a row comes
    start = time.monotonic()
    batcher.submit(prepared(1), lease=None)  # not a full pass, but the device is idle
    wait_until(lambda: passes.pending == 0, "the capture after the pass")
    assert time.monotonic() - start < 2.5, "the lone row waited for the batch window"
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
    """Both services export the process's GraphStats under their own prefix, read at scrape time."""
    from prometheus_client import CollectorRegistry

    from kev.serving.graph_metrics import GraphCollector

    metrics = ScorerMetrics()
    stats = GraphStats(replays=7, eager_bucketed=2, unbucketed=1, captures=5, row_tokens=300, padding_tokens=20,
                       state_tokens=4000, state_padding_tokens=96)
    metrics.watch_graphs(lambda: stats)
    text = generate_latest(metrics.registry).decode()
    assert 'kev_scorer_graph_passes_total{path="replay"} 7.0' in text
    assert 'kev_scorer_graph_passes_total{path="eager_bucketed"} 2.0' in text
    assert 'kev_scorer_graph_passes_total{path="unbucketed"} 1.0' in text
    assert "kev_scorer_graph_captures_total 5.0" in text
    assert 'kev_scorer_graph_real_tokens_total{kind="rows"} 300.0' in text
    assert 'kev_scorer_graph_padding_tokens_total{kind="rows"} 20.0' in text
    assert 'kev_scorer_graph_real_tokens_total{kind="state"} 4000.0' in text
    assert 'kev_scorer_graph_padding_tokens_total{kind="state"} 96.0' in text
    assert stats.eager == 3  # every path but replay
    stats.replays = 9  # read at scrape time
    assert 'path="replay"} 9.0' in generate_latest(metrics.registry).decode()
    on_cpu = ScorerMetrics()
    on_cpu.watch_graphs(lambda: None)
    assert "kev_scorer_graph" not in generate_latest(on_cpu.registry).decode()
    bank = CollectorRegistry()  # the bank's, as bank_service/server.py registers it
    bank.register(GraphCollector("kev_bank", lambda: stats))
    text = generate_latest(bank).decode()
    assert 'kev_bank_graph_passes_total{path="replay"} 9.0' in text and "kev_scorer" not in text
    assert 'kev_bank_graph_padding_tokens_total{kind="state"} 96.0' in text


# ---- a loaded scorer's cut-back (KEV_ROW_CUT_BACK) ------------------------------------------------

class CuttingPasses(FakePasses):
    def rows_to_take(self, row_lens) -> int:  # a ladder whose next step always pads: leave the last row out
        return max(1, len(row_lens) - 1)


@pytest.mark.parametrize("cut_back", [False, True])
def test_a_loaded_scorer_cuts_its_next_pass_back(monkeypatch, cut_back):
    """With a pass on the device, a pass of every queued row is cut back to its key's step below
    (its trailing rows join the next pass) only with KEV_ROW_CUT_BACK; a pass with nothing on the
    device, or a row passed over before, is never cut."""
    passes, launched = CuttingPasses(), []
    gate, first = threading.Event(), threading.Event()

    def fake_launch(self, rows):
        launched.append([(r.job.prepared.name, r.index) for r in rows])
        token = object()  # stands in for a pass on the device until its answers are read
        with self._cond:
            self._running.add(token)
        if len(launched) == 1:
            first.set()
            assert gate.wait(10)
        return token

    def fake_finish(self, token):
        with self._cond:
            self._running.discard(token)

    monkeypatch.setattr(RowBatcher, "_launch", fake_launch)
    monkeypatch.setattr(RowBatcher, "_finish", fake_finish)
    link = SimpleNamespace(current=SimpleNamespace(passes=passes))
    metrics = ScorerMetrics()
    batcher = RowBatcher(link, None, metrics, max_rows_per_pass=96, max_tokens_per_pass=1000, max_wait_ms=0,
                         max_queue=100, cut_back=cut_back)
    passes.batcher = batcher

    def named(name, n_rows):
        rows = [SimpleNamespace(prompt=SimpleNamespace(ids=[1, 2, 3]))] * n_rows
        return SimpleNamespace(name=name, rows=rows)

    try:
        batcher.submit(named("a", 2), lease=None)
        assert first.wait(5)  # nothing was on the device: both rows at once, uncut
        batcher.submit(named("b", 6), lease=None)
        gate.set()
        wait_until(lambda: sum(map(len, launched)) == 8, "every row launched")
    finally:
        gate.set()
        batcher.stop(5)
    b = [("b", i) for i in range(6)]
    if cut_back:  # b's last row waits for the next pass, and is not cut from it again
        assert launched == [[("a", 0), ("a", 1)], b[:5], b[5:]]
        assert metrics.rows_passed_over._value.get() == 1
    else:
        assert launched == [[("a", 0), ("a", 1)], b]


def test_a_row_is_passed_over_once_at_most():
    batcher = RowBatcher(SimpleNamespace(current=SimpleNamespace(passes=CuttingPasses())), None, ScorerMetrics(),
                         max_rows_per_pass=96, max_tokens_per_pass=1000, max_wait_ms=0, max_queue=100,
                         cut_back=True)
    try:
        from scorer_service.batcher import _Row

        w = SimpleNamespace()
        rows = [_Row(None, i, 3) for i in range(3)]
        picks = [(w, r) for r in rows]
        with batcher._cond:
            assert batcher._cut_back(picks) == picks[:2] and rows[2].passed_over
            assert batcher._cut_back(picks) == picks  # its trailing row was passed over once already
    finally:
        batcher.stop(5)
