# The two set-up commands of the README. Both install what they need on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch 2.13.0 resolves to the CPU build that these machines carry; the rest comes from PyPI.
install: $(BIN)/python
	command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'

demo: install
	$(BIN)/python -m kev.demo

# Two workers (CI's 2 cores): the stack tests spend much of their time waiting on their child
# processes; --dist loadfile keeps each file on one worker (a module fixture starts one stack).
test: install
	PYTHON=$(BIN)/python bash deploy/tools.sh
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadfile
