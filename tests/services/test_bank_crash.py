"""Clean crashes (issue 27): a bank killed with SIGKILL leaves no shared-memory segment behind
(its reaper unlinks it), and a bank starting next to a dead instance's file reclaims it. Real
bank processes (tests/tiny_stack.py) on a real redis-server."""

from __future__ import annotations

import os
import subprocess
import sys

from kev.bank.shared import reclaim_stale_segments
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)
from service_support import wait_for
from tiny_stack import make_tiny_checkpoint, start_bank


def test_sigkilled_bank_leaves_no_segment_and_stale_files_are_reclaimed(redis_server, tmp_path):  # noqa: F811
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    bank = start_bank(ckpt, redis_server.url, tmp_path / "logs", metrics=False)
    try:
        files = bank.shm_files()
        assert len(files) == 1, files
        bank.kill()  # SIGKILL: nothing of the bank's own clean-up runs
        wait_for(lambda: not files[0].exists(), 5, "the dead bank's segment unlinked by its reaper", every=0.02)
    finally:
        bank.kill()

    # A dead instance's file whose reaper died too (a container killed whole): reclaimed at start-up;
    # a file whose owner lives (its lock held) is never touched.
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = shm / f"kev-bank-1a2b-{int(dead.stdout)}-deadbeef"
    stale.write_bytes(b"x" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl,os,sys,time\n"
                               f"fd=os.open('{shm}/kev-bank-1a2b-'+str(os.getpid())+'-cafe', os.O_RDWR|os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        live = shm / f"kev-bank-1a2b-{holder.pid}-cafe"
        foreign = shm / "other-file"
        foreign.write_bytes(b"")
        assert reclaim_stale_segments(shm) == [stale]
        assert live.exists() and foreign.exists() and not stale.exists()
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(live)
    assert reclaim_stale_segments(shm) == [live]  # its owner is gone now


def test_a_scorer_drops_a_dead_banks_mappings(checkpoint):
    """Issue 28: a scorer that outlives its bank keeps no mapping of the dead instance's memory (on a
    GPU it would stay allocated under the next bank): within a few seconds of a SIGKILL its process
    maps none of the old instance's files (pools, generations, weights). The next bank shares no
    weights (KEV_SHARE_WEIGHTS=off): the scorer re-attaches, reads its own copy and answers the same."""
    from pathlib import Path

    import grpc

    from kev.v1 import scorer_pb2_grpc
    from service_support import make_documents, make_requests, score, stack_for

    request = make_requests(1, make_documents(1, seed=5), seed=6)[0]
    with stack_for(checkpoint) as stack:
        maps = Path(f"/proc/{stack.scorers[0].pid}/maps")
        with grpc.insecure_channel(stack.scorer_addr) as channel:
            want = score(scorer_pb2_grpc.ScorerStub(channel), request)
        mapped = {line.split()[-1] for line in maps.read_text().splitlines() if "kev-bank-" in line}
        assert any(p.endswith("-weights") for p in mapped) and len(mapped) >= 2, mapped
        stack.stop_bank(kill=True)
        wait_for(lambda: not any(p in maps.read_text() for p in mapped), 10, "the dead bank's files unmapped")
        stack.bank.env["KEV_SHARE_WEIGHTS"] = "off"
        stack.start_bank()
        with grpc.insecure_channel(stack.scorer_addr) as channel:
            got = score(scorer_pb2_grpc.ScorerStub(channel), request)
        assert got.answers == want.answers
        assert "shares no weights: reading them from" in Path(stack.scorers[0].log_path).read_text()
        assert "-weights" not in maps.read_text()
