"""Start-up progress of `python -m kev.stack` (issue 29): the services' `start-up:` log lines, followed
and printed (a bar on a terminal, plain lines otherwise); `--bank-memory` sizes; on CUDA (marked gpu)
the warm-up classes k/n and graphs captured k/n lines."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kev.stack import LogFollower, ProgressPrinter, Stack, parse_size

DEMO = Path(__file__).resolve().parents[2] / "kev" / "demo_model"


def test_parse_size():
    assert parse_size("256M") == 256 << 20 and parse_size("8G") == 8 << 30 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("65536") == 65536 and parse_size("64k") == 64 << 10
    with pytest.raises(ValueError):
        parse_size("lots")


def test_log_follower_reports_start_up_lines(tmp_path):
    seen = []
    follower = LogFollower(tmp_path, lambda proc, msg: seen.append((proc, msg)))
    (tmp_path / "redis.log").write_text("start-up: not a service\n")
    log = tmp_path / "scorer0.log"
    log.write_text("2026 INFO x: config {}\n2026 INFO kev.exec.warm_up: start-up: warm-up classes 1/3 (rows)\n"
                   "2026 INFO x: start-up: graphs capt")
    follower.poll()
    with open(log, "a") as f:
        f.write("ured 2/9 (key)\n")
    follower.poll()
    assert seen == [("scorer0", "warm-up classes 1/3 (rows)"), ("scorer0", "graphs captured 2/9 (key)")]


def test_progress_printer_plain_and_tty():
    plain = io.StringIO()
    p = ProgressPrinter(plain, tty=False)
    p("bank", "loading weights from m on cuda")
    p("scorer0", "graphs captured 2/4 (k)")
    lines = plain.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].endswith("scorer0: graphs captured 2/4 (k)")
    tty = io.StringIO()
    p = ProgressPrinter(tty, tty=True, width=8)
    p("scorer0", "warm-up classes 1/2 (rows)")
    p("scorer0", "warm-up classes 2/2 (sweep)")
    out = tty.getvalue()
    assert "[####....] 1/2" in out and "[########] 2/2\n" in out and "\r\x1b[K" in out


@pytest.mark.gpu
def test_cuda_start_up_prints_classes_and_graphs_progress():
    seen = []
    with Stack(DEMO, device="cuda", start_timeout_s=900, progress=lambda proc, msg: seen.append((proc, msg))):
        pass
    text = "\n".join(f"{p}: {m}" for p, m in seen)
    # the bank reads the weights; the scorer maps the bank's (one copy a GPU, kev/bank/shared_weights.py)
    assert "bank: loading weights" in text and "scorer0: loading " in text and "weights come with the bank" in text
    for proc in ("bank", "scorer0"):
        assert f"{proc}: ready in" in text
        assert any(p == proc and m.startswith("warm-up classes ") and "/" in m for p, m in seen), text
        assert any(p == proc and m.startswith("graphs captured ") for p, m in seen), text
