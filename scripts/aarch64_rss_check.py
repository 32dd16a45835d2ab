"""RSS within budget, seen from outside: a small CNN trained under vtensor.MemoryManager at half
its unmanaged peak, the training process's resident set sampled by another process.

Written for scripts/check-aarch64.sh (part "rss"; not part of CI), it runs on any Linux machine
from the repository root::

    python scripts/aarch64_rss_check.py [--iters 4] [--batch 16] [--tolerance 0.25]

This process (the monitor) starts the trainer (this file with ``--child``) and reads its
``/proc/PID/status`` VmRSS every ``--interval-ms``, while the trainer announces its phases on
stdout. Every phase starts after a quiet pause, so the RSS sampled just before a phase is its
entry RSS. The trainer runs

1. two unmanaged iterations (forward, backward, SGD step);
2. two managed iterations at an unlimited budget (1 TiB): the manager's reported peak of these
   is the unmanaged peak, as in tests/vtensor/activations/test_equivalence.py;
3. ``--iters`` managed iterations at half that peak.

PASS when, in every managed iteration at half the peak,

- the report's ``peak_device_bytes`` is within ``budget_bytes``, and
- the RSS rise (peak RSS in the iteration minus the entry RSS) stays within the budget plus the
  tolerance: ``--tolerance`` (default 25 %) of the budget plus ``--slack-mib`` (default 2 MiB),
  for what the budget does not hold (count_workspaces is off: convolution workspaces and
  short-lived tensors between hook points; qemu's translated code under emulation),

and the check can tell: the unmanaged iterations' RSS rise exceeds that limit (else an
unmanaged run would pass too, and the check is inconclusive: FAIL). The budget also holds the
tensors alive at entry (parameters, gradients, optimizer state, the batch), which the RSS rise
leaves out, so the comparison errs on the lenient side by those few hundred KB.

Environment: set ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc) so freed memory goes back to the OS at
once (NOTE [honest RSS] in vtensor/measure/rss.py); on aarch64 torch allocates through mimalloc,
which vtensor sets to do the same (NOTE [CPU counter] in vtensor/measure/counter.py). The exit status is 0 on PASS, 1 on FAIL.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QUIET_S = 0.5  # pause before each phase: the monitor reads the entry RSS in it
UNLIMITED = "1TiB"


def _child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # vtensor, uninstalled
    import torch
    from torch import nn

    import vtensor

    def mark(phase: str) -> None:
        print(f"MARK {phase}", flush=True)

    def quiet(phase: str) -> None:
        mark("quiet")
        time.sleep(QUIET_S)
        mark(phase)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Large activations, few parameters: conv-bn-relu x4 at 64x64, 32 channels.
    layers: list[nn.Module] = []
    channels = 3
    for _ in range(4):
        layers += [nn.Conv2d(channels, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
        channels = 32
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 16, 10))
    x = torch.randn(args.batch, 3, 64, 64)
    y = torch.randint(0, 10, (args.batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def iteration(manager: "vtensor.MemoryManager | None", phase: str) -> dict[str, object] | None:
        opt.zero_grad(set_to_none=True)
        quiet(phase)
        if manager is None:
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            with manager.step(model, opt, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
        mark("after")
        opt.step()
        if manager is None:
            return None
        r = manager.report()
        return {
            "phase": phase,
            "plan_source": str(r.plan_source),
            "budget_bytes": r.budget_bytes,
            "peak_device_bytes": r.peak_device_bytes,
            "min_budget_bytes": r.min_budget_bytes,
            "bytes_out": r.bytes_out,
            "bytes_in": r.bytes_in,
            "one_time_bytes": r.one_time_bytes,
            "wall_s": r.wall_s,
        }

    out: dict[str, object] = {"torch": torch.__version__, "unlimited": [], "managed": []}
    for i in range(2):
        iteration(None, f"unmanaged{i}")
    with tempfile.TemporaryDirectory(prefix="rss-check-") as storage:
        with vtensor.MemoryManager(UNLIMITED, storage_dir=storage) as mm:
            for i in range(2):
                out["unlimited"].append(iteration(mm, f"unlimited{i}"))  # type: ignore[union-attr]
        peak = max(int(r["peak_device_bytes"]) for r in out["unlimited"])  # type: ignore[union-attr,index]
        budget = peak // 2
        out["unmanaged_peak_bytes"] = peak
        out["budget_bytes"] = budget
        try:
            if budget <= 0:
                raise ValueError(f"the manager reported an unmanaged peak of {peak} bytes")
            with vtensor.MemoryManager(budget, storage_dir=storage) as mm:
                for i in range(args.iters):
                    out["managed"].append(iteration(mm, f"managed{i}"))  # type: ignore[union-attr]
        except (vtensor.VTensorError, ValueError) as err:
            out["error"] = f"{type(err).__name__}: {err}"
    mark("quiet")
    print("RESULT " + json.dumps(out), flush=True)


def _vmrss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _monitor(args: argparse.Namespace) -> int:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--iters",
        str(args.iters),
        "--batch",
        str(args.batch),
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent
    )
    assert proc.stdout is not None
    state = {"phase": "start"}
    entry: dict[str, int] = {}  # phase -> last RSS sampled in the quiet pause before it
    peak: dict[str, int] = {}  # phase -> highest RSS sampled while it ran
    result: list[dict[str, object]] = []
    last_quiet = [0]

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("MARK "):
                phase = line.split()[1]
                if phase not in ("quiet", "after"):
                    entry[phase] = last_quiet[0]
                    sample = _vmrss_bytes(proc.pid)
                    peak[phase] = max(peak.get(phase, 0), sample or 0)
                state["phase"] = phase
            elif line.startswith("RESULT "):
                result.append(json.loads(line[len("RESULT ") :]))
            else:
                print("child:", line, end="")

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    interval = args.interval_ms / 1000
    while proc.poll() is None:
        rss = _vmrss_bytes(proc.pid)
        if rss is not None:
            phase = state["phase"]
            if phase == "quiet":
                last_quiet[0] = rss
            elif phase != "after":
                peak[phase] = max(peak.get(phase, 0), rss)
        time.sleep(interval)
    thread.join(timeout=10)
    wall = time.monotonic() - t0
    if proc.returncode != 0 or not result:
        print(f"rss-check: FAIL: the trainer exited with {proc.returncode} ({wall:.0f} s)")
        return 1
    out = result[0]
    mib = 1 << 20
    budget = int(out["budget_bytes"])  # type: ignore[call-overload]
    limit = int(budget * (1 + args.tolerance) + args.slack_mib * mib)
    print(
        f"rss-check: torch {out['torch']}, batch {args.batch}, sampled every "
        f"{args.interval_ms} ms from outside, {wall:.0f} s"
    )
    print(
        f"rss-check: unmanaged peak (manager, 1 TiB budget) {out['unmanaged_peak_bytes'] / mib:.2f} MiB;"
        f" budget {budget / mib:.2f} MiB; RSS-rise limit {limit / mib:.2f} MiB"
        f" (+{args.tolerance:.0%} +{args.slack_mib} MiB)"
    )
    failures: list[str] = []

    def rise(phase: str) -> int:
        return peak.get(phase, 0) - entry.get(phase, 0)

    for phase in [p for p in peak if p.startswith(("unmanaged", "unlimited"))]:
        print(
            f"  {phase:11s} entry RSS {entry.get(phase, 0) / mib:8.2f} MiB, "
            f"rise {rise(phase) / mib:7.2f} MiB"
        )
    for r in out["unlimited"]:  # type: ignore[union-attr]
        print(f"  {r['phase']:11s} report peak {r['peak_device_bytes'] / mib:7.2f} MiB")
    unmanaged_rise = max(rise(p) for p in peak if p.startswith("unmanaged"))
    if unmanaged_rise <= limit:
        failures.append(
            f"inconclusive: the unmanaged RSS rise {unmanaged_rise / mib:.2f} MiB is within the "
            f"limit {limit / mib:.2f} MiB"
        )
    ratio = out["unmanaged_peak_bytes"] / max(1, unmanaged_rise)  # type: ignore[operator]
    print(f"  the manager's unmanaged peak is {ratio:.2f}x the unmanaged RSS rise")
    for r in out["managed"]:  # type: ignore[union-attr]
        phase = str(r["phase"])
        ok_report = r["peak_device_bytes"] <= r["budget_bytes"]
        ok_rss = rise(phase) <= limit
        print(
            f"  {phase:11s} [{r['plan_source']}] report peak {r['peak_device_bytes'] / mib:7.2f} MiB"
            f" {'<=' if ok_report else '>'} budget; RSS rise {rise(phase) / mib:7.2f} MiB "
            f"{'<=' if ok_rss else '>'} limit (entry {entry.get(phase, 0) / mib:.2f}, peak "
            f"{peak.get(phase, 0) / mib:.2f} MiB); out {r['bytes_out'] / mib:.2f} MiB; "
            f"{r['wall_s']:.1f} s"
        )
        if not ok_report:
            failures.append(f"{phase}: report peak {r['peak_device_bytes']} > budget {budget}")
        if not ok_rss:
            failures.append(f"{phase}: RSS rise {rise(phase)} > limit {limit}")
    if "error" in out:
        failures.append(f"managed run at half the peak failed: {out['error']}")
    elif len(out["managed"]) != args.iters:  # type: ignore[arg-type]
        failures.append(f"{len(out['managed'])} of {args.iters} managed iterations ran")  # type: ignore[arg-type]
    max_rise = max((rise(str(r["phase"])) for r in out["managed"]), default=0)  # type: ignore[union-attr]
    max_report = max((int(r["peak_device_bytes"]) for r in out["managed"]), default=0)  # type: ignore[union-attr]
    for f in failures:
        print(f"rss-check: {f}")
    verdict = "PASS" if not failures else "FAIL"
    print(
        f"rss-check: {verdict}: budget {budget / mib:.2f} MiB, report peak {max_report / mib:.2f} MiB,"
        f" RSS rise {max_rise / mib:.2f} MiB (limit {limit / mib:.2f} MiB), unmanaged RSS rise "
        f"{unmanaged_rise / mib:.2f} MiB"
    )
    return 0 if not failures else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=4, help="managed iterations at half the peak")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--interval-ms", type=float, default=2.0, help="RSS sampling period")
    parser.add_argument("--tolerance", type=float, default=0.25, help="fraction of the budget")
    parser.add_argument("--slack-mib", type=float, default=2.0, help="fixed allowance")
    args = parser.parse_args()
    if args.child:
        _child(args)
    else:
        sys.exit(_monitor(args))


if __name__ == "__main__":
    main()
