"""What bench/load_compare.py writes: the sample-answer comparison across systems and one
results file per workload, built from whatever has been measured so far (a run cut short by a
timeout still leaves a complete, honest file: `missing` names what was not measured), and where
each service's start-up time went, from its log."""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from pathlib import Path

import grpc

from bench.load import SCORE_METHOD, json_safe
from bench.load_workloads import LoadRequest
from kev.v1 import scorer_pb2 as pb

HEADLINE = ("clients", "requests_per_s", "p50_ms", "p90_ms", "p99_ms", "errors", "error_count", "error_messages",
            "bank_hit_ratio", "tokens_per_s", "matmul_tflops", "ceiling_fraction", "matmul_tflops_sustained",
            "ceiling_fraction_sustained", "matmul_sustained_gpu", "eager_passes_after_warmup",
            "rows_per_pass", "row_tokens_per_pass", "scorer_bank_hit_ratio", "row_pass_ms", "row_worker_busy",
            "row_passes_by_path", "row_padding_share", "state_passes", "documents_per_state_pass", "state_pass_ms", "state_worker_busy",
            "state_padding_share", "new_document_acquire_ms", "request_phase_ms", "scorer_cpu_cores", "bank_cpu_cores",
            "peak_gpu_memory_gb", "requests", "elapsed_s")


def sample_answers(addr: str, sample: list[LoadRequest], timeout_s: float) -> list[dict[str, list[float]] | str]:
    """Each request's probabilities per question (option order), sent one at a time; an error's status name."""
    out = []
    with grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.unary_unary(SCORE_METHOD, request_serializer=None,
                                   response_deserializer=pb.ScoreQuestionsResponse.FromString)
        for item in sample:
            try:
                reply = call(item.payload, timeout=timeout_s)
            except grpc.RpcError as e:
                out.append(e.code().name)
                continue
            answers = {}
            for name, q in item.request.questions.items():
                a = reply.answers[name]
                kind = a.WhichOneof("answer")
                if kind == "noul":
                    answers[name] = [a.noul.p_yes]
                elif kind == "choice":
                    answers[name] = [a.choice.probabilities[c.name] for c in q.options]
                else:
                    answers[name] = list(a.score.probabilities)
            out.append(answers)
    return out


def compare(ours: list, theirs: list) -> dict:
    """Bit-identity and the largest absolute difference of two systems' sample answers."""
    questions = mismatched = failed = 0
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        if isinstance(a, str) or isinstance(b, str):
            failed += 1
            continue
        for name, pa in a.items():
            pb_ = b.get(name, [])
            questions += 1
            if pa != pb_:
                mismatched += 1
                worst = max(worst, max((abs(x - y) for x, y in zip(pa, pb_)), default=math.inf))
    return {"sample_requests": len(ours), "questions": questions, "failed_requests": failed,
            "mismatched_questions": mismatched, "max_abs_diff": worst,
            "identical": failed == 0 and mismatched == 0 and questions > 0}


def headline(runs: list[dict], clients: int) -> dict:
    run = next((r for r in runs if r["clients"] == clients), runs[-1] if runs else {})
    return {k: run.get(k) for k in HEADLINE}


def speedups(ours: list[dict], theirs: list[dict]) -> dict[str, float]:
    """Client count -> our requests/s over theirs, for every count both measured."""
    base = {r["clients"]: r["requests_per_s"] for r in theirs if r.get("requests_per_s")}
    return {str(r["clients"]): r["requests_per_s"] / base[r["clients"]] for r in ours
            if r["clients"] in base and r.get("requests_per_s") is not None}


def model_label(args) -> str:
    """What the results ran: a Kev size's shapes with random weights on the GPU (`--model`)."""
    if args.device == "cpu":
        return "tiny random fp32 (CPU)"
    size = getattr(args, "model", "kev-4b").removeprefix("kev-").upper()
    return f"Kev-{size} shapes, random bf16 weights"


MATMUL_FIELDS = ("matmul_tflops", "matmul_tflops_sustained", "matmul_sustained_gpu")


def report(name: str, results: dict, systems: list[str], skipped: dict, args, env: dict, checkpoint: Path,
           startup: dict, matmul: dict | None = None) -> dict:
    """One workload's results file from what has been measured so far. `matmul` (the call's
    `measure_matmul`, before the stack started) fills the headline's matmul fields that no run has
    filled yet: a call cut during start-up still keeps the rates it measured."""
    done = {s: results[s][name] for s in systems if results.get(s, {}).get(name, {}).get("done")}
    partial = {s: results[s][name] for s in systems if s not in done and results.get(s, {}).get(name, {}).get("runs")}
    have = {**partial, **done}
    out = {**{k: env[k] for k in ("commit", "gpu")}, "workload": name, "device": args.device,
           "model": model_label(args),
           "checkpoint": str(checkpoint), "scale": args.scale,
           "missing": [s for s in systems if s not in done], "complete": len(done) == len(systems)}
    overrides = service_overrides(args)
    out["default_startup"] = not overrides  # the bank and kev scorer ran with their defaults (module docstring)
    if overrides:
        out["service_overrides"] = overrides
    kev = have.get("kev")
    out.update(headline(kev["runs"] if kev else [], args.clients))
    for field in MATMUL_FIELDS:
        if out.get(field) is None and matmul:
            out[field] = matmul.get(field)
    out["sweep"] = kev["runs"] if kev else []
    for system in ("gathered", "baseline"):
        if system in have:
            # each system's object stands on its own: the same commit and GPU as the headline's run
            out[system] = {"commit": env["commit"], "gpu": env["gpu"], **headline(have[system]["runs"], args.clients),
                           "sweep": have[system]["runs"],
                           **({} if system in done else {"partial": True})}
        elif system in systems:
            out[system] = {"missing": "not measured: the run stopped before it (see `missing`)"}
        else:
            out[system] = {"skipped": skipped.get(system, "not requested")}
    if kev and "baseline" in have:
        out["speedup_by_clients"] = speedups(kev["runs"], have["baseline"]["runs"])
        # the headline ratio only from two runs at the same client count (a cut run's headline
        # falls back to its last client count)
        if out["baseline"]["clients"] == out["clients"] and out["baseline"]["requests_per_s"] \
                and out["requests_per_s"] is not None:
            out["speedup_vs_baseline"] = out["requests_per_s"] / out["baseline"]["requests_per_s"]
        out["baseline_answers"] = compare(kev["sample"], have["baseline"]["sample"])
    if kev and "gathered" in have:
        out["gathered_bit_identical"] = compare(kev["sample"], have["gathered"]["sample"])
    out["startup"] = startup
    out["settings"] = {k: v for k, v in vars(args).items() if k not in ("workload",)}
    out["packages"], out["python"], out["host"], out["command"] = (env["packages"], env["python"], env["host"],
                                                                   env["command"])
    out["triton_compile_cache"], out["gpu_sharing"] = env["triton_compile_cache"], env["gpu_sharing"]
    return out


def service_overrides(args) -> dict:
    """The settings bench/load_compare.py was told to give the services beyond the harness's own
    (device, bank memory, document limit, metrics ports, torch threads); {} when none."""
    given = {"bank_env": dict(getattr(args, "bank_env", [])), "scorer_env": dict(getattr(args, "scorer_env", [])),
             "bank_flags": list(getattr(args, "bank_flag", [])), "scorer_flags": list(getattr(args, "scorer_flag", []))}
    return {k: v for k, v in given.items() if v}


def write_quietly(path: Path, obj) -> None:
    """JSON to `path` through a temporary file and a rename: a kill never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(json_safe(obj), indent=2))
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# the start-up breakdown from a service log

_PATTERNS = {
    "weights_s": r"(?:weights loaded in|model \S+ loaded in|loaded \S+ on \S+ in) ([\d.]+) s",
    "class_warm_up_s": r"(?:autotune classes .* warmed|warmed \d+ padded shapes \(rows x width\)) in ([\d.]+) s",
    "graph_capture_s": r"captured \d+ CUDA graphs in ([\d.]+) s",
    "graphs": r"captured (\d+) CUDA graphs in",
}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_READY = re.compile(r"serving kev\.v1\.Bank|serving \(ready after|serving on ")


def startup_breakdown(log_text: str) -> dict[str, float | int | None]:
    """Seconds a service spent on its weights, the autotune class warm-up and the start-up graph
    captures, and from its first log line to SERVING (`ready_s`); None where the log does not say."""
    out: dict[str, float | int | None] = {}
    for name, pattern in _PATTERNS.items():
        m = re.search(pattern, log_text)
        out[name] = None if m is None else (int(m.group(1)) if name == "graphs" else float(m.group(1)))
    stamps = [(m.group(1), line) for line in log_text.splitlines() if (m := _STAMP.match(line))]
    ready = next((t for t, line in stamps if _READY.search(line)), None)
    if stamps and ready is not None:
        fmt = "%Y-%m-%d %H:%M:%S,%f"
        out["ready_s"] = round((datetime.strptime(ready, fmt) - datetime.strptime(stamps[0][0], fmt)).total_seconds(), 1)
    else:
        out["ready_s"] = None
    return out


def format_breakdown(name: str, b: dict) -> str:
    show = lambda v: "?" if v is None else f"{v:.0f} s" if isinstance(v, float) else str(v)  # noqa: E731
    return (f"{name}: ready {show(b.get('ready_s'))} (weights {show(b.get('weights_s'))}, class warm-up "
            f"{show(b.get('class_warm_up_s'))}, {show(b.get('graphs'))} graphs captured in "
            f"{show(b.get('graph_capture_s'))})")
