#!/usr/bin/env bash
# Run the main job: a federated simulation (Flower simulation engine) of 8 memory-limited clients
# training under vtensor budgets. Arguments are Hydra overrides for `python -m edgefl.sim`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
exec "$ROOT/.venv/bin/python" -m edgefl.sim "$@"
