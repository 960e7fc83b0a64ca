"""deploy/monitoring/ (issue 29): the Grafana dashboard and the Prometheus alert rules parse, and every
metric they name is one the scorer (scorer_service/metrics.py) or the bank (bank_service/metrics.py)
exports, under the sample names Prometheus stores (counters `_total`, histograms `_bucket` / `_count` /
`_sum`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from bank_service.metrics import BankMetrics
from kev.bank.bank import BankStats
from kev.exec.graphs import GraphStats
from kev.serving.graph_metrics import GraphCollector
from scorer_service.metrics import ScorerMetrics

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
METRIC = re.compile(r"\bkev_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported() -> set[str]:
    scorer = ScorerMetrics()
    scorer.watch_graphs(GraphStats)  # CUDA's graph counters (on CPU nothing is exported for them)
    fields = {f: 0 for f in BankStats.__dataclass_fields__}
    bank = BankMetrics(lambda: BankStats(**fields))
    bank.registry.register(GraphCollector("kev_bank", GraphStats))  # as bank_service/server.py does on CUDA
    names = set()
    for registry in (scorer.registry, bank.registry):
        for family in registry.collect():
            names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def named(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in METRIC.findall(e)}


def test_dashboard_parses_and_names_exported_metrics():
    dash = json.loads((MONITORING / "kev-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = named(exprs)
    assert used - exported() == set()
    for needed in ("kev_scorer_requests_seconds_bucket", "kev_scorer_queue_depth", "kev_scorer_rows_per_pass_sum",
                   "kev_scorer_tokens_per_pass_sum", "kev_scorer_graph_padding_tokens_total",
                   "kev_scorer_graph_passes_total", "kev_bank_graph_passes_total",
                   "kev_bank_graph_padding_tokens_total", "kev_bank_slots_used", "kev_scorer_bank_lookups_total",
                   "kev_bank_evictions_total", "kev_scorer_pins_held", "kev_scorer_lease_renewals_total"):
        assert needed in used, needed
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_alert_rules_parse_and_name_exported_metrics():
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert {"KevNoBank", "KevQueueSaturated", "KevEagerPassesUnderLoad", "KevPinnedEntryLost",
            "KevBankFullOfPins"} <= {r["alert"] for r in alerts}
    for r in alerts:
        assert r["expr"] and r["annotations"]["summary"] and r["labels"]["severity"] in ("warning", "critical")
    assert named([r["expr"] for r in alerts]) - exported() == set()
