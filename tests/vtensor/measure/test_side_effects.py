"""vtensor leaves process-wide counters alone unless asked to measure peaks."""

import subprocess
import sys

_SCRIPT = r"""
import sys
import torch
from torch import nn
import vtensor

def vmhwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

measure = sys.argv[1] == "measure"
# Made first: where torch allocates through its own mimalloc, the manager has it hand freed
# memory back at once (NOTE [CPU counter]), so the big tensor's pages leave when it goes.
mm = vtensor.MemoryManager("1GiB", measure_peaks=measure)
big = torch.ones(256 << 20, dtype=torch.uint8)  # raise the high-water mark by 256 MiB
del big
before = vmhwm()
model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
x = torch.randn(512, 256)
with mm:
    for _ in range(2):
        with mm.step(model, inputs=(x,)):
            model(x).sum().backward()
print(before, vmhwm(), mm.report().peak_independent_bytes)
"""


def _run(mode: str) -> tuple[int, int, str]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, independent = done.stdout.split()
    return int(before), int(after), independent


def test_the_process_high_water_mark_is_left_alone_by_default() -> None:
    before, after, independent = _run("default")
    assert after >= before  # VmHWM never went back down: nobody reset it
    assert independent == "None"


def test_measuring_peaks_resets_it_and_says_so() -> None:
    before, after, independent = _run("measure")
    assert after < before - 128 * 2**20  # reset through /proc/self/clear_refs
    assert int(independent) > 0
