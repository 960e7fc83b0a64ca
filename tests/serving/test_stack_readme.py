"""The README's "Run a stack and call it", run verbatim on CPU (issue 29).

Every fenced block of that section runs as written: the first (`python -m kev.stack ...`) in the
background until it prints `stack ready`, the `bash` ones in bash, the `python` ones in Python, in a
scratch directory that links `kev/` so the README's relative paths hold, with `.venv/bin` first on
PATH (as after `source .venv/bin/activate`). Then `kev score` on out-of-vocabulary text must warn.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Run a stack and call it"
PORT = 50051  # the README's (the scorer's default and `kev`'s)
NEWS = ("The central bank raised interest rates by a quarter point on Wednesday, citing persistent inflation "
        "and a tight labour market, while signalling that further increases may be needed later this year.")


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the README's section."""
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else None]
    return re.findall(r"^```(\w+)\n(.*?)^```", section, flags=re.M | re.S)


def json_documents(text: str) -> list[dict]:
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def readme_stack(tmp_path_factory):
    blocks = readme_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "python", "python"]
    if not port_free(PORT):
        pytest.skip(f"port {PORT} (the README's) is taken on this machine")
    work = tmp_path_factory.mktemp("readme")
    (work / "kev").symlink_to(REPO / "kev")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env = {k: v for k, v in env.items() if not k.startswith("KEV_")}
    stack = subprocess.Popen(["bash", "-c", blocks[0][1]], cwd=work, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    console = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = stack.stdout.readline()
            if not line:
                break
            console.append(line)
            if line.startswith("try: kev models"):
                break
        assert any(l.startswith("stack ready in") for l in console), "".join(console)
        yield work, env, blocks, console
    finally:
        os.killpg(stack.pid, signal.SIGINT)  # the stack's own processes are in sessions of their own
        try:
            stack.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(stack.pid, signal.SIGKILL)
            stack.wait()


def run(lang: str, code: str, work: Path, env: dict) -> subprocess.CompletedProcess:
    args = ["bash", "-ec", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_readme_stack_console_shows_progress(readme_stack):
    _, _, _, console = readme_stack
    text = "".join(console)
    assert "bank: loading weights" in text and "scorer0: ready in" in text
    assert f"scorer 127.0.0.1:{PORT}" in text


def test_readme_cli(readme_stack):
    work, env, blocks, _ = readme_stack
    done = run(*blocks[1], work, env)
    score, models = json_documents(done.stdout)
    assert list(score["answers"]) == ["refund", "team", "urgency"]  # request order
    assert score["answers"]["team"]["choice"]["choice"] == "billing"
    assert list(score["answers"]["team"]["choice"]["probabilities"]) == ["billing", "technical", "shipping", "account"]
    assert score["answers"]["refund"]["noul"]["p_yes"] > 0.5
    assert score["usage"]["unknown_tokens"] == 0 and isinstance(score["usage"]["input_tokens"], int)
    assert "warning" not in done.stderr
    assert models["models"][0]["id"] == "kev-demo-tiny"


def test_readme_python_client(readme_stack):
    work, env, blocks, _ = readme_stack
    out = run(*blocks[2], work, env).stdout.split()
    assert out[0] == "technical" and float(out[1]) < 0.5 and "unknown_tokens=0" in " ".join(out)


def test_readme_reflection_call(readme_stack):
    work, env, blocks, _ = readme_stack
    reply = json.loads(run(*blocks[3], work, env).stdout)
    assert reply["answers"]["team"]["choice"]["choice"] == "shipping"


def test_kev_score_warns_on_out_of_vocabulary_text(readme_stack):
    work, env, _, _ = readme_stack
    (work / "news.json").write_text(json.dumps({"document": NEWS, "questions": {
        "urgent": {"type": "noul", "instructions": "is this ticket urgent ?"}}}))
    done = run("bash", "kev score news.json", work, env)
    usage = json.loads(done.stdout)["usage"]
    assert usage["unknown_tokens"] >= 0.1 * usage["input_tokens"] > 0
    assert re.search(r"warning: \d+ of \d+ input tokens \(\d+%\) are unknown to the model's tokenizer", done.stderr)
