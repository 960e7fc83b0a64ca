"""Both services' CUDA-graph counters, read from the process's `kev.exec.graphs.GraphStats` when
Prometheus scrapes (None on CPU: nothing exported). The passes count them; nothing here touches a pass.

    <prefix>_graph_passes_total{path}       replay (a CUDA graph), eager_bucketed (a key without its
                                            graph yet), unbucketed (beyond the pass caps): every
                                            path but replay is an eager pass
    <prefix>_graph_captures_total           CUDA graphs captured (start-up, re-attach, sweeps when idle)
    <prefix>_graph_real_tokens_total{kind}  real tokens of keyed passes (rows / state)
    <prefix>_graph_padding_tokens_total{kind}  the padding their keys added
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily

PATHS = (("replay", "replays"), ("eager_bucketed", "eager_bucketed"), ("unbucketed", "unbucketed"))


class GraphCollector:
    def __init__(self, prefix: str, stats: Callable[[], object | None]):
        self.prefix, self.stats = prefix, stats

    def describe(self):
        return []  # unchecked at registration: the names are only known here

    def collect(self):
        s = self.stats()
        if s is None:
            return
        p = self.prefix
        passes = CounterMetricFamily(f"{p}_graph_passes", "Passes by CUDA-graph path", labels=["path"])
        for label, attr in PATHS:
            passes.add_metric([label], getattr(s, attr))
        yield passes
        yield CounterMetricFamily(f"{p}_graph_captures", "CUDA graphs captured", value=s.captures)
        real = CounterMetricFamily(f"{p}_graph_real_tokens", "Real tokens of keyed passes", labels=["kind"])
        pad = CounterMetricFamily(f"{p}_graph_padding_tokens", "Padding tokens of keyed passes", labels=["kind"])
        real.add_metric(["rows"], s.row_tokens)
        real.add_metric(["state"], s.state_tokens)
        pad.add_metric(["rows"], s.padding_tokens)
        pad.add_metric(["state"], s.state_padding_tokens)
        yield real
        yield pad
