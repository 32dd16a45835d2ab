#!/usr/bin/env bash
# Run the main job: for now the vtensor demo, training a model under a memory budget.
# Arguments are passed on to `python -m vtensor.demo`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
exec "$ROOT/.venv/bin/python" -m vtensor.demo "$@"
