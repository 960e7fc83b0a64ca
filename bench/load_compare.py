"""Issue 7 side by side: the project, its gathered-state variant and a naive baseline, same load.

All systems run on the same device and the same checkpoint, one at a time, each driven by the
same closed-loop load (bench/load.py):

- `kev`: the embedded stack (kev.stack: Redis, bank_service, a scorer_service), bank-indexed row
  passes (KEV_OPS=triton on GPU, the torch reference on CPU);
- `gathered`: a second scorer on the same stack and bank with KEV_OPS=gathered (each row's state
  copied into row buffers first); it idles while `kev` is measured and the other way round. GPU
  only (its Triton kernels do not run on a CPU). Sharing the stack saves a bank start (minutes at
  Kev-4B); its load uses another seed, so its documents are new to the bank too;
- `baseline`: bench/load_baseline.py, started after the stack is stopped: transformers re-reading
  the document for every question in one padded forward per batch of waiting requests.

Before the load each system answers the same sample of requests, one at a time (so every system
runs them in the same pass shapes): `gathered` reads the very states `kev`'s sample stored, and
their probabilities must be bit-identical (kev's second answers, from the cached states: the first
may come from the bank's idle sweep, whose head runs outside the row graphs); the baseline's largest difference from the project's is
recorded (bf16 on GPU: not expected to be zero).

The bank and the kev scorer start with their defaults: no start-up plan (KEV_CUDA_GRAPHS,
KEV_WARM_CLASSES) and no bank layout (`--avg-doc-tokens`) fitted to the workload, only what the
harness always sets (device, bank memory, the document limit, metrics ports, torch threads). A figure then says how the defaults serve traffic they were not fitted to.
`--bank-env` / `--scorer-env KEY=VAL` and `--bank-flag` / `--scorer-flag` remain for experiments;
any of them makes the results say `"default_startup": false` (and list them in `service_overrides`).
The gathered scorer's prefix buffer (`--gathered-max-prefix-tokens`, default the longest document)
and the baseline's warm-up shapes do follow the workload: they are comparison systems, not the
services, and without them the one refuses long documents and the other compiles in the window.
The log says where each service's start-up time went (weights, class warm-up, graph captures).

Order: the stack with the kev scorer is started and measured, then the baseline (the stack idles
beside it, or is stopped first when no gathered scorer follows), then the gathered scorer is added
to the stack and measured: the figures the acceptance compares come first when a run is cut short.

Writes `<out-dir>/load_<workload>.json` per workload, rewritten after every run of every system, so a
run cut short (a `timeout`) leaves what it measured: `missing` lists the systems not (yet) measured
and `complete` is false until none is. Fields: `commit`, `gpu`, `clients`, `requests_per_s`,
`p50_ms`, `p90_ms`, `p99_ms`, `errors` (by gRPC status, with `error_messages`: the first message of
each), bank hit ratio and rows per pass for the project, `tokens_per_s`, `matmul_tflops` (measured
in a child process before the stack starts, null on CPU; a file cut during start-up keeps it),
`ceiling_fraction`, the sustained rate and `ceiling_fraction_sustained` with the clock while it was
measured, and `eager_passes_after_warmup` (bench/load.py), the same fields in `gathered` and `baseline`, the
sweep of every system, the ratio to the baseline, the identity check, `default_startup`,
`startup` (seconds per service), package versions and the exact command; with `--sweep`, also
`<png-dir>/load_<workload>.png` (requests/s and p99 against clients). The JSON keeps its plain name
(bench/results/ by default, overwritten: the commit is inside it); the plot, like every per-run log,
goes to the git-ignored runs/. Exit status 1 on any error or mismatch.

GPU (Kev-4B shapes by default, `--model` for another Kev size; random bf16 weights written once to
/tmp/<model>-random). The H200 machine has
no redis-server and lacks grpcio-health-checking, grpcio-reflection and redis-py: carry `.whl` (fla),
`.whl_load` (cp312 wheels) and `.redis_carry` (see bench/device/device_check.py), one workload per command
(each must end inside 10 minutes; `timeout` makes this driver stop its services first):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl .whl_load/*.whl && export PYTHONPATH=/tmp/site PATH=$PWD/.redis_carry:$PATH KEV_COMMIT=<sha>
    python3 bench/device/device_check.py && timeout 570 python3 -m bench.load_compare --device cuda \
        --workload six-short --sweep 1,8,32,64 --duration 8 --warmup-s 2 --out-dir $OUT --png-dir $OUT

CPU (a tiny random checkpoint; documents scaled down):

    python -m bench.load_compare --device cpu --workload six-short --clients 8 --duration 5 --scale 0.5
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.load import (add_run_args, environment, json_safe, measure_matmul, parse_counts, run_load,
                        served_params)
from bench.load_report import (format_breakdown, report, sample_answers, service_overrides, startup_breakdown,
                               write_quietly)
from bench.load_workloads import WORKLOADS, LoadRequest, RequestStream, TextMaker, Workload, load_builder
from bench.common import KEV_MODELS
from bench.random_checkpoint import write_random_checkpoint
from kev.serving.processes import REPO_ROOT, Proc, free_port
from kev.stack import Stack

SYSTEMS = ("kev", "gathered", "baseline")
START_TIMEOUT_S = 900.0  # Kev-4B: 8 GB of weights per process, then warm-up and autotune


# ---------------------------------------------------------------------------------------------
# the systems


class Running:
    """A started system: its scorer address, metrics URL and how to stop it."""

    def __init__(self, addr: str, metrics_url: str, stop, logs, bank_metrics_url: str | None = None,
                 service_metrics_urls: dict[str, str] | None = None):
        self.addr, self.metrics_url, self.stop, self.logs = addr, metrics_url, stop, logs
        self.bank_metrics_url = bank_metrics_url  # the stack's bank (state passes, acquires); None: no bank
        # every service of the stack while this system runs, whose eager passes count; {}: none (the baseline)
        self.service_metrics_urls = service_metrics_urls or {}
        self.startup: dict | None = None


def start_stack(checkpoint: Path, args) -> tuple[Stack, Running, dict, dict]:
    """The stack with the `kev` scorer, its `Running`, the start-up breakdown (wall seconds, and per
    service what its log says) and the ports (`add_gathered` puts its scorer beside it later).
    The services get only the harness's settings and the `--*-env` / `--*-flag` overrides."""
    ports = {"kev": free_port(), "gathered": free_port(), "bank": free_port()}
    stack = Stack(checkpoint, device=args.device, bank_memory_bytes=int(args.bank_gb * 2**30),
                  max_document_tokens=args.max_document_tokens,
                  scorer_env={"KEV_METRICS_PORT": str(ports["kev"]), **dict(args.scorer_env)},
                  bank_env={"KEV_METRICS_PORT": str(ports["bank"]), **dict(args.bank_env)},
                  bank_flags=list(args.bank_flag), scorer_flags=list(args.scorer_flag),
                  torch_threads=args.torch_threads, start_timeout_s=START_TIMEOUT_S)
    start = time.perf_counter()
    stack.start()
    startup = {"wall": {"bank_and_kev_scorer_s": round(time.perf_counter() - start, 1)}}
    for name, proc in (("bank", stack.bank), ("kev", stack.scorers[0])):
        startup[name] = startup_breakdown(proc.log_path.read_text(errors="replace"))
    return stack, _scorer_running(stack, 0, ports), startup, ports


def add_gathered(stack: Stack, args, ports: dict, startup: dict) -> Running:
    """The gathered-state scorer on the same bank (its start-up goes into `startup`)."""
    start = time.perf_counter()
    stack.add_scorer(env={"KEV_OPS": "gathered", "KEV_METRICS_PORT": str(ports["gathered"]),
                          "KEV_GATHERED_MAX_PREFIX_TOKENS": str(args.gathered_max_prefix_tokens)})
    startup["wall"]["gathered_scorer_s"] = round(time.perf_counter() - start, 1)
    startup["gathered"] = startup_breakdown(stack.scorers[1].log_path.read_text(errors="replace"))
    return _scorer_running(stack, 1, ports)


def _scorer_running(stack: Stack, index: int, ports: dict) -> Running:
    name = ("kev", "gathered")[index]
    logs = lambda: {p.name: p.log_tail(2000) for p in (stack.bank, *stack.scorers) if p is not None}  # noqa: E731
    url = lambda service: f"http://127.0.0.1:{ports[service]}/metrics"  # noqa: E731
    return Running(stack.scorer_addrs[index], url(name), stack.stop, logs, bank_metrics_url=url("bank"),
                   service_metrics_urls={s: url(s) for s in ("bank", "kev", "gathered")[:index + 2]})


def start_baseline(checkpoint: Path, args, workdir: Path) -> Running:
    port, metrics_port = free_port(), free_port()
    addr = f"127.0.0.1:{port}"
    # TRITON_CACHE_AUTOTUNING: the baseline's (fla's) autotune results go to Triton's cache dir,
    # which bench/device/load_check.sh carries between device calls: a later start re-tunes nothing.
    # Start-up only: a cached pick is one the same kernels made on the same kind of GPU and shapes.
    # (The project's services keep their hot kernels off the disk cache: kev.ops.autotune.ClassTuner.)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_AUTOTUNING": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "bench.load_baseline", "--checkpoint", str(checkpoint), "--device", args.device,
           "--listen", addr, "--metrics-port", str(metrics_port), "--max-batch-tokens", str(args.baseline_max_batch_tokens),
           "--max-document-tokens", str(args.max_document_tokens), "--torch-threads", str(args.torch_threads),
           "--warm-widths", ",".join(map(str, args.baseline_warm_widths)), "--warm-rows", str(args.baseline_warm_rows),
           "--warm-min-rows", str(args.baseline_warm_min_rows)]
    proc = Proc("baseline", cmd, env, workdir / "baseline.log")
    proc.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        with grpc.insecure_channel(addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if not proc.alive or time.monotonic() > deadline:
                    raise RuntimeError(f"the baseline did not start; log tail:\n{proc.log_tail()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service="kev.v1.Scorer"), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
    except BaseException:
        # a failed start, or a SIGTERM (a `timeout` around the run) while it warms up: the process
        # runs in a session of its own, so nothing else would stop it (session 30's cut call left
        # it running, with the MPS server it held)
        proc.stop()
        raise
    running = Running(addr, f"http://127.0.0.1:{metrics_port}/metrics", proc.stop,
                      lambda: {"baseline": proc.log_tail(2000)})
    text = proc.log_path.read_text(errors="replace")
    running.startup = startup_breakdown(text)
    for line in text.splitlines():  # where the baseline's start-up went, shape by shape
        if "warm-up forwards:" in line or "out of GPU memory warming" in line:
            print(f"   baseline: {line.split(' ', 3)[-1]}", file=sys.stderr, flush=True)
    return running


# ---------------------------------------------------------------------------------------------
# the run


def stored_sample_answers(addr: str, sample: list[LoadRequest], timeout_s: float) -> list:
    """The sample's answers read from stored states: asked twice, the second answers. The first
    time a new document is stored, and a request that finds the stack idle is answered in its
    document's sweep by the bank (its head outside the row graphs: other low bits); the second
    time every document is cached and the rows run in the row passes the gathered scorer runs too."""
    sample_answers(addr, sample, timeout_s)
    return sample_answers(addr, sample, timeout_s)


def measure(system: str, running: Running, checkpoint: Path, args, workloads: list[str], seed: int,
            results: dict, save, matmul: dict | None = None, kev_addr: str | None = None) -> None:
    """Per workload: the sample answers, then the runs (sweep or one client count), each stored in
    `results[system][workload]` and saved (`save()`) as soon as it is done. `kev_addr`: the kev
    scorer beside a gathered one, which answers the sample again just before it (the reference)."""
    model_id, tokenizer, builder = load_builder(checkpoint, args.max_document_tokens)
    maker = TextMaker(tokenizer, builder)
    params = served_params(checkpoint)
    for name in workloads:
        stream = RequestStream(maker, model_id, WORKLOADS[name].scaled(args.scale), seed)
        sample = stream.sample(args.sample)
        if system == "gathered" and name in results.get("kev", {}):
            # kev's load since its sample may have evicted the sample's documents, and a document
            # read again may be read differently (alone in an idle sweep: other GEMM shapes, other
            # low bits): kev answers the sample again now, from the states the gathered scorer
            # reads next, and those answers are the ones compared.
            results["kev"][name]["sample"] = stored_sample_answers(kev_addr, sample, args.timeout_s)
        entry = results.setdefault(system, {})[name] = {"runs": []}
        entry["sample"] = stored_sample_answers(running.addr, sample, args.timeout_s) if system == "kev" \
            else sample_answers(running.addr, sample, args.timeout_s)
        for n in sweep_of(system, args):
            baseline = system == "baseline"
            duration = args.baseline_duration if baseline and args.baseline_duration else args.duration
            warmup = args.baseline_warmup_s if baseline and args.baseline_warmup_s is not None else args.warmup_s
            with GpuMemoryPeak() as peak:  # the whole pod: bank and scorers (issue 28)
                run = run_load(running.addr, stream, n, duration_s=duration, max_requests=args.requests,
                               warmup_s=warmup, timeout_s=args.timeout_s,
                               metrics_url=running.metrics_url, bank_metrics_url=running.bank_metrics_url,
                               service_metrics_urls=running.service_metrics_urls,
                               matmul=matmul, non_embedding_params=params, label=f"{system} {name} x{n}")
            run["peak_gpu_memory_gb"] = peak.gb
            entry["runs"].append(run)
            save()
        entry["done"] = True
        save()


class GpuMemoryPeak:
    """The most GPU memory in use (MB, every process on the GPUs: the whole pod) while the block
    runs, from `nvidia-smi` every `every_s`; `gb` is None where there is no nvidia-smi (CPU runs)."""

    def __init__(self, every_s: float = 0.25, command: str = "nvidia-smi"):
        self.every_s, self.command = every_s, command
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gpu-memory-peak", daemon=True)

    @property
    def gb(self) -> float | None:
        return None if self.peak_mb is None else round(self.peak_mb * 2**20 / 1e9, 2)

    def sample(self) -> float | None:
        """MB in use now, summed over the GPUs (None without nvidia-smi)."""
        try:
            out = subprocess.run([self.command, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        values = [float(v) for v in out.stdout.split() if v.replace(".", "", 1).isdigit()]
        return sum(values) if out.returncode == 0 and values else None

    def _poll(self) -> None:
        while True:
            mb = self.sample()
            if mb is not None:
                self.peak_mb = mb if self.peak_mb is None else max(self.peak_mb, mb)
            if mb is None or self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "GpuMemoryPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def sweep_of(system: str, args) -> list[int]:
    """The client counts `system` runs: its own `--<system>-sweep`, else `--sweep`, else `--clients`."""
    own = getattr(args, f"{system}_sweep", None)
    return own or args.sweep or [args.clients]


def apply_comparison_defaults(args, workloads: list[str]) -> None:
    """What the comparison systems get from the workloads (the services get nothing): the gathered
    scorer's prefix buffer, the longest document; the baseline's warm-up shapes (`baseline_warm_shapes`)."""
    used = [WORKLOADS[w].scaled(args.scale) for w in workloads]
    if args.gathered_max_prefix_tokens is None:
        args.gathered_max_prefix_tokens = max(w.longest_document for w in used)
    widths, most_rows, fewest_rows = baseline_warm_shapes(used, sweep_of("baseline", args))
    args.baseline_warm_widths, args.baseline_warm_rows = widths, most_rows
    if getattr(args, "baseline_warm_min_rows", None) is None:
        args.baseline_warm_min_rows = fewest_rows


def baseline_warm_shapes(workloads: list[Workload], clients: list[int], max_requests: int = 64) -> tuple[list[int], int, int]:
    """(sequence lengths, most rows, fewest rows) of the baseline's forwards under these workloads and
    client counts, which it runs once at start-up: a padded forward's width is its longest document +
    row (a fixed-length workload has one; lengths that vary give both ends), and it holds from one
    request's questions up to the sweep's widest batch (`max_requests` requests)."""
    widths = set()
    for w in workloads:
        widths.update(n + r for n in (w.doc_range or w.doc_tokens) for r in set(w.row_tokens))
    most = min(max(clients), max_requests) * max(w.questions[1] for w in workloads)
    return sorted(widths), most, min(w.questions[0] for w in workloads)


def result_stem(model: str, workload: str) -> str:
    """`load_<workload>` for Kev-4B (the figures' history), `load_<size>_<workload>` for another size
    (issue 28's `load_27b_varied.json`)."""
    return f"load_{workload}" if model == "kev-4b" else f"load_{model.removeprefix('kev-')}_{workload}"


def parse_env(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def show(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda | cpu")
    p.add_argument("--workload", default="six-short", help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--systems", default=None, help="comma-separated subset of kev,gathered,baseline "
                   "(default: all on GPU, kev,baseline on CPU)")
    p.add_argument("--checkpoint", default=None, help="default: a random checkpoint written to --checkpoint-dir")
    p.add_argument("--checkpoint-dir", default=None, help="default /tmp/<model>-random (GPU) or a temp dir (CPU)")
    p.add_argument("--model", choices=list(KEV_MODELS), default="kev-4b",
                   help="the Kev size of the random checkpoint on the GPU (bench/common.py; CPU: a tiny model)")
    p.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"),
                   help="where load_<workload>.json goes (its plain name, overwritten)")
    p.add_argument("--png-dir", default=str(REPO_ROOT / "runs"),
                   help="where load_<workload>.png goes (default runs/, git-ignored)")
    p.add_argument("--sample", type=int, default=8, help="requests per workload compared across systems")
    for system in ("baseline", "gathered"):
        p.add_argument(f"--{system}-sweep", type=parse_counts, default=None,
                       help=f"the {system}'s client counts (default --sweep); must hold --clients, whose run "
                            "the results compare")
    p.add_argument("--baseline-duration", type=float, default=None,
                   help="the baseline's window (default --duration): five-long x 64's padded forwards take "
                        "seconds each, and a window must hold several of them")
    p.add_argument("--baseline-warmup-s", type=float, default=None,
                   help="the baseline's warm-up before each window (default --warmup-s). fla recompiles and "
                        "re-tunes its l2norm for every new rows x width product (its NB key), ~10 s each on the "
                        "H200: where the start-up cannot run every shape (mixed), a longer warm-up keeps "
                        "those compiles out of the window")
    p.add_argument("--baseline-warm-min-rows", type=int, default=None,
                   help="the fewest rows of the baseline's start-up shapes (default: one request's rows). A "
                        "64-client-only sweep batches ~190 rows a forward: 96 warms what its window runs, "
                        "--baseline-warmup-s absorbs the ramp's smaller shapes, and the start-up is ~70 s shorter")
    p.add_argument("--bank-gb", type=float, default=None, help="bank memory (default 48 GiB on GPU, 64 MiB on CPU)")
    p.add_argument("--max-document-tokens", type=int, default=65536)
    p.add_argument("--baseline-max-batch-tokens", type=int, default=786432)
    p.add_argument("--torch-threads", type=int, default=None, help="per service process (default 1 on CPU, 4 on GPU)")
    p.add_argument("--gathered-max-prefix-tokens", type=int, default=None,
                   help="KEV_GATHERED_MAX_PREFIX_TOKENS of the gathered scorer (default: the longest document)")
    # For experiments: any of these makes the results say "default_startup": false.
    p.add_argument("--bank-flag", action="append", default=[], help="extra bank_service flag (repeatable)")
    p.add_argument("--scorer-flag", action="append", default=[], help="extra flag of every scorer (repeatable)")
    p.add_argument("--bank-env", action="append", type=parse_env, default=[], metavar="KEY=VAL",
                   help="extra bank_service setting, e.g. KEV_CUDA_GRAPHS=0 (repeatable)")
    p.add_argument("--scorer-env", action="append", type=parse_env, default=[], metavar="KEY=VAL",
                   help="extra setting of every scorer, e.g. KEV_WARM_CLASSES=none (repeatable)")
    add_run_args(p)
    args = p.parse_args(argv)
    # A SIGTERM (a `timeout` around the run) unwinds like Ctrl-C, so the stack's processes, which
    # run in their own sessions, are stopped and do not hold the GPU after this process is gone.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workloads = [w for w in args.workload.split(",") if w]
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        p.error(f"unknown workload(s) {unknown}; known: {sorted(WORKLOADS)}")
    on_gpu = args.device != "cpu"
    systems = args.systems.split(",") if args.systems else list(SYSTEMS if on_gpu else ("kev", "baseline"))
    if any(s not in SYSTEMS for s in systems) or "kev" not in systems:
        p.error(f"--systems must name kev and any of gathered, baseline (got {args.systems!r})")
    if args.bank_gb is None:
        args.bank_gb = 48.0 if on_gpu else 64 / 1024
    if args.torch_threads is None:
        args.torch_threads = 4 if on_gpu else 1
    if args.sweep and args.clients not in args.sweep:
        args.clients = max(args.sweep)
    for system in ("baseline", "gathered"):
        if (own := getattr(args, f"{system}_sweep")) and args.clients not in own:
            p.error(f"--{system}-sweep {own} must hold {args.clients} clients (the compared run)")
    apply_comparison_defaults(args, workloads)
    overrides = service_overrides(args)
    print(f"== services: {'their defaults' if not overrides else f'overridden {overrides}'}; gathered scorer "
          f"KEV_GATHERED_MAX_PREFIX_TOKENS={args.gathered_max_prefix_tokens}; baseline warm widths "
          f"{args.baseline_warm_widths} rows {args.baseline_warm_min_rows}..{args.baseline_warm_rows}",
          file=sys.stderr, flush=True)

    env = environment()
    workdir = Path(tempfile.mkdtemp(prefix="kev-load-"))  # the baseline's log; the CPU checkpoint
    atexit.register(shutil.rmtree, workdir, True)
    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
    else:
        where = args.checkpoint_dir or (f"/tmp/{args.model}-random" if on_gpu else workdir / "tiny-random")
        checkpoint = write_random_checkpoint(where, args.model if on_gpu else "tiny", args.device)

    skipped = {} if on_gpu else {"gathered": "CPU run: the gathered ops are Triton kernels (GPU only)"}
    # Before any service holds the GPU, on the GPU they will share (the rate varies run to run)
    matmul = measure_matmul() if on_gpu else None
    tflops = matmul and matmul["matmul_tflops"]
    print(f"== matmul: {tflops if tflops is None else f'{tflops:.0f}'} TFLOPS (bf16), sustained "
          f"{(matmul or {}).get('matmul_tflops_sustained')} at {(matmul or {}).get('matmul_sustained_gpu')}",
          file=sys.stderr, flush=True)
    systems = [s for s in systems if s not in skipped]
    results: dict[str, dict] = {}
    startup: dict = {}

    def save() -> None:
        for name in workloads:
            write_quietly(Path(args.out_dir) / f"{result_stem(args.model, name)}.json",
                          report(name, results, systems, skipped, args, env, checkpoint, startup, matmul))

    def measure_all(system: str, running: Running, seed: int, kev_addr: str | None = None) -> None:
        try:
            measure(system, running, checkpoint, args, workloads, seed, results, save, matmul, kev_addr)
        except BaseException:
            for proc, tail in running.logs().items():
                print(f"--- {proc} log tail ---\n{tail}", file=sys.stderr)
            raise

    save()  # every system missing: a run killed during start-up still leaves its settings
    # Order: kev, then the baseline (the stack idles meanwhile, its GPU memory kept), then the
    # gathered scorer beside kev: the figures the acceptance compares come first if time runs out.
    start = time.perf_counter()
    print("== stack: starting", file=sys.stderr, flush=True)
    stack, kev, startup["stack"], ports = start_stack(checkpoint, args)
    print(f"== stack: serving after {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    try:
        for name in ("bank", "kev"):
            print(f"   {format_breakdown(name, startup['stack'][name])}", file=sys.stderr, flush=True)
        measure_all("kev", kev, args.seed)
        if "baseline" in systems:
            if "gathered" not in systems:
                # Nothing later needs the stack: the baseline gets the GPU's memory to itself (longdoc's
                # 8 x 61,472-token forward ran out of it beside an idle 48 GiB bank, cb9932f).
                stack.stop()
                startup["stack_stopped_before_baseline"] = True
            start = time.perf_counter()
            print("== baseline: starting", file=sys.stderr, flush=True)
            baseline = start_baseline(checkpoint, args, workdir)
            startup["baseline"] = {"wall_s": round(time.perf_counter() - start, 1), **(baseline.startup or {})}
            print(f"== baseline: serving after {time.perf_counter() - start:.0f} s; "
                  f"{format_breakdown('baseline', startup['baseline'])}", file=sys.stderr, flush=True)
            try:
                measure_all("baseline", baseline, args.seed)
            finally:
                baseline.stop()
        if "gathered" in systems:
            print("== gathered scorer: starting", file=sys.stderr, flush=True)
            gathered = add_gathered(stack, args, ports, startup["stack"])
            print(f"   {format_breakdown('gathered', startup['stack']['gathered'])}", file=sys.stderr, flush=True)
            measure_all("gathered", gathered, args.seed + 1, kev.addr)  # its load's documents new to the bank
    finally:
        stack.stop()

    failed = False
    for name in workloads:
        out = report(name, results, systems, skipped, args, env, checkpoint, startup, matmul)
        from bench.common import write_json

        write_json(str(Path(args.out_dir) / f"{result_stem(args.model, name)}.json"), json_safe(out))
        per_system = {"kev": out} | {s: out[s] for s in ("gathered", "baseline") if "sweep" in out[s]}
        errors = sum(o.get("error_count") or 0 for o in per_system.values())
        identical = out.get("gathered_bit_identical", {}).get("identical")
        failed |= errors > 0 or identical is False or not out["complete"]
        if args.sweep and len(args.sweep) > 1:
            from bench.load_plots import plot_sweeps

            plot_sweeps({s: results[s][name]["runs"] for s in results if name in results[s]},
                        Path(args.png_dir) / f"{result_stem(args.model, name)}.png", title=f"{name} ({out['gpu']})")
        print(f"{name}: kev {out['requests_per_s']:.1f} req/s p99 {out['p99_ms']:.1f} ms, "
              f"{out['tokens_per_s']:.0f} tokens/s ({show(out['ceiling_fraction'], '.1%')} of the matmul ceiling), "
              f"eager passes {show(out['eager_passes_after_warmup'], 'd')}, errors {errors}, "
              f"gathered bit-identical: {'not run' if identical is None else identical}", file=sys.stderr)
        for system, o in per_system.items():
            for run in o["sweep"]:
                if run.get("error_count"):
                    print(f"  {system} x{run['clients']}: errors {run['errors']}; first messages "
                          f"{run['error_messages']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
