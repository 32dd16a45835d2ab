#!/usr/bin/env bash
# Check vtensor on aarch64 (Raspberry Pi 5 / Jetson CPU; Raspberry Pi 4 with --cpu cortex-a72) under
# qemu-user emulation, in a Debian bookworm arm64 chroot. NOT part of CI (scripts/test.sh does not
# call it): a manual check, run as root on an x86-64 Debian host. See shared/notes/aarch64.md.
#
# What it does, each setup step skipped when its stamp file says it is done (so a second run only
# runs the checks):
#   1. host: apt-get installs qemu-user-static, debootstrap and binfmt-support where missing, mounts
#      binfmt_misc and enables qemu-aarch64;
#   2. debootstraps a bookworm arm64 root (python3, python3-venv) in $EDGEFL_AARCH64_DIR/root
#      (default /var/cache/edgefl-aarch64; ~5 min, ~500 MB);
#   3. downloads the aarch64 wheels with the HOST's pip (torch and vtensor's test dependencies:
#      numpy, cryptography, pytest, pytest-timeout, hypothesis) into $DIR/wheels/TORCH and
#      installs them with the host's pip --target into the venv /proj/venv-TORCH inside the root.
#      torch 2.13.0's aarch64 wheel is the CUDA-13 build: it pulls ~2.7 GB of NVIDIA wheels
#      (4.5 GB installed; `import torch` loads libcudart): ~1 min download, ~1 min install;
#   4. mounts proc, sys, dev, a fake aarch64 /proc/cpuinfo (two Cortex-A76 cores like a Pi 5, or
#      two Cortex-A72 cores like a Pi 4: torch's CPU detection segfaults on the x86 one) and this
#      checkout, read-only, at /proj/src; everything is unmounted on exit, in reverse order;
#   5. runs, in the chroot with QEMU_CPU=<cpu> and no allocator option (torch's aarch64 wheel
#      allocates through a mimalloc in libc10, which vtensor sets to return freed memory at once;
#      NOTE [CPU counter] in vtensor/measure/counter.py):
#        (a) import: `import torch`, its version, a 256x256 matmul;
#        (b) tests:  pytest -q over tests/vtensor/measure/ (all of it) and a subset of
#                    tests/vtensor/activations/test_equivalence.py: by default
#                    -k "cnn or transformer or not test_equivalence", i.e. the equivalence cases
#                    of the zoo's cnn and transformer (every budget and mode: 20 of its 50
#                    tests), because the whole file takes ~40 min emulated (90 s natively);
#                    --all runs all of it, -k EXPR any subset;
#        (c) rss:    scripts/aarch64_rss_check.py: a small CNN trained under vtensor.MemoryManager
#                    at half its unmanaged peak, its RSS sampled from outside (/proc/PID/status);
#   6. prints one summary line, PASS/FAIL per part, and exits non-zero if any part failed.
#
# How long: first run ~5 min of setup (debootstrap ~3 min, wheels ~1 min, install ~1 min), then
# the checks, which emulation makes ~25x slower than native (measured with other jobs on the 2
# cores): (a) ~20 s, (b) ~31 min (2.5 min natively; --all: ~60 min), (c) ~6 min (14 s natively).
# Logs go to $DIR/logs/, one set per run. Only one check at a time (a lock in $DIR); the machine has 2 cores, so do not run it
# beside another emulated pytest.
#
# Usage: sudo scripts/check-aarch64.sh [--torch VERSION] [--cpu cortex-a76|cortex-a72]
#            [--only import,tests,rss] [--all | -k EXPR] [--prepare] [--clean] [-- PYTEST_ARGS]
#   --torch 2.13.0       the torch version to install and test (default 2.13.0). Each version has its
#                        own venv in the root. For a Raspberry Pi 4 (Cortex-A72, ARMv8.0: no LSE
#                        atomics) use --torch 2.9.1 --cpu cortex-a72: PyPI's aarch64 torch is a
#                        CUDA build from 2.11.0 on (NVPL BLAS: SIGILL at the first matmul on
#                        ARMv8.0), and 2.10.0, the last CPU-only one, dies with SIGILL in
#                        `import torch` there (pytorch/pytorch#176993); 2.9.1 (+cpu, OpenBLAS,
#                        104 MB wheel, no mimalloc) runs. vtensor pins 2.13.0: see the log for what
#                        fails with an older torch.
#   --cpu cortex-a76     QEMU_CPU and the fake cpuinfo: cortex-a76 (Pi 5) or cortex-a72 (Pi 4)
#   --only PARTS         comma-separated parts to run among import,tests,rss (default all)
#   --all                all the equivalence tests (no -k)
#   -k EXPR              pytest -k expression for part (b), instead of the default subset
#   --tests "PATHS"      the test files, folders or node ids of part (b), instead of the two above
#                        (the -k expression still applies: add --all to drop it)
#   --prepare            set up only (steps 1-3), run no checks
#   --clean              delete the cached root, wheels and stamps first
#   -- ARGS              further arguments for pytest
# Environment: EDGEFL_AARCH64_DIR (cache folder), EDGEFL_AARCH64_MIRROR (Debian mirror),
#   EDGEFL_AARCH64_TEST_TIMEOUT (pytest-timeout per test under emulation, default 3600 s).
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${EDGEFL_AARCH64_DIR:-/var/cache/edgefl-aarch64}"
MIRROR="${EDGEFL_AARCH64_MIRROR:-http://deb.debian.org/debian}"
TEST_TIMEOUT="${EDGEFL_AARCH64_TEST_TIMEOUT:-3600}"
TORCH=2.13.0
CPU=cortex-a76
PARTS=import,tests,rss
KEXPR="cnn or transformer or not test_equivalence"
PREPARE=0
CLEAN=0
PYTEST_EXTRA=()
TESTS=(tests/vtensor/activations/test_equivalence.py tests/vtensor/measure/)

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --torch) TORCH="$2"; shift 2 ;;
        --cpu) CPU="$2"; shift 2 ;;
        --only) PARTS="$2"; shift 2 ;;
        --all) KEXPR=""; shift ;;
        -k) KEXPR="$2"; shift 2 ;;
        --tests) read -r -a TESTS <<<"$2"; shift 2 ;;
        --prepare) PREPARE=1; shift ;;
        --clean) CLEAN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; PYTEST_EXTRA=("$@"); break ;;
        *) echo "check-aarch64: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$CPU" in cortex-a76|cortex-a72) ;; *) echo "check-aarch64: --cpu must be cortex-a76 or cortex-a72" >&2; exit 2 ;; esac
if [[ "$CPU" == cortex-a72 && "$(printf '%s\n' "$TORCH" 2.9.99 | sort -V | head -1)" != "$TORCH" ]]; then
    echo "check-aarch64: warning: torch $TORCH dies with SIGILL on ARMv8.0 (cortex-a72); 2.9.1 runs" >&2
fi
[[ $EUID -eq 0 ]] || { echo "check-aarch64: must run as root (debootstrap, mount, chroot)" >&2; exit 2; }

ROOT="$DIR/root"
STAMPS="$DIR/stamps"
WHEELS="$DIR/wheels/$TORCH"    # the wheels of this torch version and its requirements
LOGS="$DIR/logs"
VENV="/proj/venv-$TORCH"          # inside the root
SITE="$ROOT$VENV/lib/python3.11/site-packages"
REQS=("torch==$TORCH" numpy cryptography pytest pytest-timeout hypothesis)
# With --platform, pip takes only the tags named: every manylinux tag that bookworm's glibc 2.36
# runs (torch is manylinux_2_28, nvidia-cudnn-cu13 manylinux_2_27, nvidia-nccl-cu13 manylinux_2_18).
PLATFORM_FLAGS=(--only-binary=:all: --python-version 3.11 --implementation cp
    --abi cp311 --abi abi3 --abi none --platform manylinux2014_aarch64 --platform linux_aarch64)
for minor in $(seq 17 36); do PLATFORM_FLAGS+=(--platform "manylinux_2_${minor}_aarch64"); done
# pip of the host: the project venv's, else the system's.
if [[ -x "$SRC/.venv/bin/python" ]]; then HOST_PY="$SRC/.venv/bin/python"; else HOST_PY=python3; fi

log() { printf '[check-aarch64 %s] %s\n' "$(date +%T)" "$*" >&2; }
TIMES=()
timed() {  # timed NAME CMD...: run CMD (with set -e in force), record its wall time under NAME
    local name="$1" t0=$SECONDS rc
    shift
    # Not `"$@" || rc=$?`: bash ignores set -e inside a function called in a condition.
    set +e
    (set -e; "$@")
    rc=$?
    set -e
    TIMES+=("$name=$((SECONDS - t0))s")
    return $rc
}

if [[ $CLEAN -eq 1 ]]; then
    if findmnt -rno TARGET | grep -q "^$ROOT/"; then
        echo "check-aarch64: mounts remain under $ROOT; unmount them first" >&2; exit 1
    fi
    log "deleting $DIR"; rm -rf "$DIR"
fi
mkdir -p "$DIR" "$STAMPS" "$LOGS"
# Two locks: setup (the root, wheels, venvs) and checks (the mounts, the emulated runs), so one
# version can be set up while another is checked; but only one check at a time.
exec 9>"$DIR/lock-setup"
flock -w 1800 9 || { echo "check-aarch64: another run holds $DIR/lock-setup" >&2; exit 1; }

# -- 1. host tools and binfmt ----------------------------------------------------------------------
step_host() {
    local missing=()
    command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v update-binfmts >/dev/null || missing+=(binfmt-support)
    if [[ ${#missing[@]} -gt 0 ]]; then
        log "apt-get install ${missing[*]}"
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
    fi
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    if ! grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null; then
        update-binfmts --enable qemu-aarch64
    fi
    grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 \
        || { log "qemu-aarch64 binfmt handler not enabled"; return 1; }
    # The F flag (qemu-user-static's default) opens the interpreter now: no copy needed in the root.
    grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
        || log "warning: qemu-aarch64 binfmt lacks the F flag; the chroot may not find its interpreter"
}

# -- 2. the arm64 root -----------------------------------------------------------------------------
step_root() {
    if [[ -f "$STAMPS/root" ]]; then return 0; fi
    if findmnt -rno TARGET | grep -q "^$ROOT/"; then
        log "mounts remain under $ROOT from an earlier run; unmount them first"; return 1
    fi
    log "debootstrap bookworm arm64 into $ROOT (~5 min; log: $LOGS/debootstrap.log)"
    rm -rf "$ROOT"
    mkdir -p "$ROOT"
    if ! debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv \
            bookworm "$ROOT" "$MIRROR" >"$LOGS/debootstrap.log" 2>&1; then
        tail -5 "$LOGS/debootstrap.log" >&2
        return 1
    fi
    chroot "$ROOT" /usr/bin/python3 -c 'import platform; print("root python", platform.python_version(), platform.machine())'
    touch "$STAMPS/root"
}

# -- 3. wheels, and the venv of this torch version -------------------------------------------------
# pip evaluates environment markers for the host even with --platform: torch 2.10.0's CUDA
# wheels, marked `platform_machine == "x86_64"`, would come along. So torch comes alone
# (--no-deps) and its requirements are evaluated here for aarch64, then downloaded with theirs.
torch_requirements() {  # torch_requirements WHEEL: its Requires-Dist that hold on linux-aarch64
    "$HOST_PY" - "$1" <<'PY'
import sys, zipfile
from pip._vendor.packaging.markers import default_environment
from pip._vendor.packaging.requirements import Requirement
env = default_environment()
env.update(platform_machine="aarch64", platform_system="Linux", sys_platform="linux",
           python_version="3.11", implementation_name="cpython", extra="")
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(env):
            req.marker = None
            print(req)
PY
}

step_wheels() {
    local want="${REQS[*]}" whl deps
    if [[ -f "$STAMPS/wheelset-$TORCH" && "$(cat "$STAMPS/wheelset-$TORCH")" == "$want" ]]; then return 0; fi
    # The wheels serve only to build the venv.
    if [[ -f "$STAMPS/venv-$TORCH" && "$(cat "$STAMPS/venv-$TORCH")" == "$want" ]]; then return 0; fi
    log "pip download (host pip, aarch64 wheels) into $WHEELS: $want"
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    "$HOST_PY" -m pip download -q --disable-pip-version-check --no-deps "${PLATFORM_FLAGS[@]}" \
        -d "$WHEELS" "torch==$TORCH"
    whl=$(ls "$WHEELS"/torch-"$TORCH"-*.whl)
    mapfile -t deps < <(torch_requirements "$whl")
    log "torch $TORCH requires on aarch64: ${deps[*]}"
    "$HOST_PY" -m pip download -q --disable-pip-version-check "${PLATFORM_FLAGS[@]}" \
        -d "$WHEELS" "${deps[@]}" "${REQS[@]:1}"
    echo "$want" >"$STAMPS/wheelset-$TORCH"
}

step_venv() {
    local want="${REQS[*]}"
    if [[ -f "$STAMPS/venv-$TORCH" && "$(cat "$STAMPS/venv-$TORCH")" == "$want" ]]; then return 0; fi
    log "venv $VENV in the root; pip install --target (host pip, ~1 min for torch 2.13.0)"
    rm -rf "$ROOT$VENV"
    chroot "$ROOT" /usr/bin/python3 -m venv --without-pip "$VENV"
    # Exactly the wheels downloaded (all resolved already): no resolution against the host.
    "$HOST_PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts --no-index --no-deps \
        "${PLATFORM_FLAGS[@]}" --no-compile --target "$SITE" "$WHEELS"/*.whl
    echo "$want" >"$STAMPS/venv-$TORCH"
}

timed host step_host
timed root step_root
timed wheels step_wheels
timed venv step_venv
log "setup done: ${TIMES[*]}; $(du -sh "$ROOT$VENV" 2>/dev/null | cut -f1) in $VENV"
exec 9>&-
if [[ $PREPARE -eq 1 ]]; then exit 0; fi
exec 8>"$DIR/lock-run"
flock -n 8 || { echo "check-aarch64: another check holds $DIR/lock-run" >&2; exit 1; }

# -- 4. fake cpuinfo and mounts --------------------------------------------------------------------
write_cpuinfo() {  # write_cpuinfo PART FEATURES VARIANT REVISION: two cores of an Arm Ltd CPU
    local i
    for i in 0 1; do
        printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: %s\nCPU implementer\t: 0x41\n' "$i" "$2"
        printf 'CPU architecture: 8\nCPU variant\t: %s\nCPU part\t: %s\nCPU revision\t: %s\n\n' "$3" "$1" "$4"
    done
}
CPUINFO="$DIR/cpuinfo-$CPU"
case "$CPU" in
    cortex-a76)  # Raspberry Pi 5 (BCM2712): ARMv8.2 with LSE atomics, dot product, fp16
        write_cpuinfo 0xd0b "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp" 0x4 1 >"$CPUINFO" ;;
    cortex-a72)  # Raspberry Pi 4 (BCM2711): ARMv8.0, no crypto extensions, no LSE atomics
        write_cpuinfo 0xd08 "fp asimd evtstrm crc32 cpuid" 0x0 3 >"$CPUINFO" ;;
esac

MOUNTED=()
cleanup() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" || log "could not unmount ${MOUNTED[i]}"
    done
    MOUNTED=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mnt() {  # mnt TARGET MOUNT-ARGS...
    local target="$1"
    shift
    mount "$@" "$target"
    MOUNTED+=("$target")
}
if findmnt -rno TARGET | grep -q "^$ROOT/"; then
    log "mounts remain under $ROOT from an earlier (killed?) run; unmount them, deepest first:"
    findmnt -rno TARGET | grep "^$ROOT/" | sort -r >&2
    exit 1
fi
mnt "$ROOT/proc" -t proc proc
mnt "$ROOT/proc/cpuinfo" --bind "$CPUINFO"
mnt "$ROOT/sys" -t sysfs sysfs
mnt "$ROOT/dev" --bind /dev
mnt "$ROOT/dev/shm" -t tmpfs tmpfs          # the host's /dev/shm is a mount of its own
mkdir -p "$ROOT/proj/src"
mnt "$ROOT/proj/src" --bind "$SRC"
mount -o remount,bind,ro "$ROOT/proj/src"

# -- 5. the checks ---------------------------------------------------------------------------------
in_root() {  # in_root CMD...: run in the chroot, in /proj/src, with the emulated CPU
    chroot "$ROOT" /usr/bin/env -i \
        PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" HOME=/root LANG=C.UTF-8 TMPDIR=/tmp \
        QEMU_CPU="$CPU" MALLOC_MMAP_THRESHOLD_=65536 \
        PYTHONDONTWRITEBYTECODE=1 HYPOTHESIS_STORAGE_DIRECTORY=/tmp/hypothesis PYTHONPATH=/proj/src \
        /bin/sh -c 'cd /proj/src && exec "$@"' sh "$@"
}
declare -A RESULT=()
want_part() { [[ ",$PARTS," == *",$1,"* ]]; }
run_part() {  # run_part NAME LOGFILE CMD...
    local name="$1" logfile="$2" rc=0
    shift 2
    log "part $name: $1 ... (log: $logfile)"
    timed "$name" bash -c '"$@" 2>&1 | tee "$0"; exit "${PIPESTATUS[0]}"' "$logfile" in_root "$@" || rc=$?
    if [[ $rc -eq 0 ]]; then RESULT[$name]=PASS; else RESULT[$name]="FAIL(rc=$rc)"; fi
}
export -f in_root
export ROOT VENV CPU
TAG="$TORCH-$CPU-$(date +%Y%m%d-%H%M%S)"   # each run its own logs

if want_part import; then
    run_part import "$LOGS/import-$TAG.log" python -c '
import platform, time, torch
t0 = time.time()
a = torch.randn(256, 256)
b = (a @ a).sum().item()
print("torch", torch.__version__, platform.machine(), "matmul 256x256 ok in %.2f s" % (time.time() - t0))
'
fi
if want_part tests; then
    K=()
    [[ -n "$KEXPR" ]] && K=(-k "$KEXPR")
    run_part tests "$LOGS/pytest-$TAG.log" python -m pytest -q -p no:cacheprovider \
        -o timeout="$TEST_TIMEOUT" -rfEs "${K[@]}" \
        "${TESTS[@]}" "${PYTEST_EXTRA[@]}"
fi
if want_part rss; then
    run_part rss "$LOGS/rss-$TAG.log" python scripts/aarch64_rss_check.py
fi

# -- 6. summary ------------------------------------------------------------------------------------
summary="check-aarch64: torch $TORCH, $CPU:"
failed=0
for p in import tests rss; do
    if want_part "$p"; then
        summary+=" $p=${RESULT[$p]:-SKIPPED}"
        [[ "${RESULT[$p]:-}" == PASS ]] || failed=1
    fi
done
if [[ $failed -eq 0 ]]; then summary+=" => PASS"; else summary+=" => FAIL"; fi
if want_part tests && [[ -f "$LOGS/pytest-$TAG.log" ]]; then
    grep -E '^(FAILED|ERROR) ' "$LOGS/pytest-$TAG.log" >&2 || true
fi
echo "times: ${TIMES[*]}"
echo "$summary"
exit $failed
