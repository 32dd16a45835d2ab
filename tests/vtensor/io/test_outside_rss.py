"""The RSS of a training child process, sampled from outside, stays within its budget plus a slack.

The child trains a model none of the other tests use under a budget of half its unmanaged
peak, counting op workspaces (``count_workspaces=True``: the budget then holds for the
process's RSS, not only for tensor bytes), with chunks released in place (NOTE [release in
place] in vtensor/io/pages.py). The parent samples the child's resident set from
``/proc/<pid>/statm`` every millisecond while it steps.
The rise over the RSS at the start of the managed steps (which already holds the parameters, the
batch, the optimizer state and what the first iteration kept for good) must stay within the
budget less that baseline, plus ``SLACK_BYTES``: the swap path's own buffers (a 4 MiB staging
buffer and a 16 MiB read-ahead window) and allocator slack.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
SLACK_BYTES = 24 * MIB
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

_CHILD = r"""
import json, sys
import torch
from torch import nn
import vtensor

torch.manual_seed(0)
# A residual tower of wide convolutions, unlike the zoo's models.
class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 48, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(48, 48, 3, padding=1), nn.SiLU(), nn.Conv2d(48, 48, 1))
            for _ in range(6)
        )
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=(2, 3)))

model = Tower()
x, y = torch.randn(16, 3, 96, 96), torch.randint(0, 10, (16,))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

def step(mm):
    optimizer.zero_grad()
    with mm.step(model, optimizer, inputs=(x, y)):
        nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()

with vtensor.MemoryManager("1TiB", storage_dir=sys.argv[1]) as probe:
    step(probe)
    step(probe)
peak = probe.report().peak_device_bytes
budget = max(peak // 2, probe.report().min_budget_bytes)
# count_workspaces: the budget holds for the process's RSS, op workspaces included.
with vtensor.MemoryManager(budget, storage_dir=sys.argv[1], count_workspaces=True) as mm:
    step(mm)  # the first managed iteration profiles; what it keeps for good stays after it
    # What the budget counts that is already resident before the steps: parameters, momentum,
    # the batch (gradients are made by each backward: part of the working set).
    state = [*model.parameters(), *(s["momentum_buffer"] for s in optimizer.state.values()), x, y]
    baseline = sum(t.untyped_storage().nbytes() for t in state)
    print(json.dumps({"phase": "ready", "budget": budget, "baseline": baseline}), flush=True)
    sys.stdin.readline()
    reports = []
    for _ in range(4):
        step(mm)
        reports.append([mm.report().bytes_out, mm.report().peak_device_bytes])
    print(json.dumps({"phase": "done", "reports": reports}), flush=True)
    sys.stdin.readline()
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def test_rss_sampled_from_outside_stays_within_the_budget(tmp_path: Path) -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        ready = json.loads(child.stdout.readline())
        assert ready["phase"] == "ready"
        start = _rss(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        highest = start
        os.set_blocking(child.stdout.fileno(), False)
        line = ""
        while not line:
            highest = max(highest, _rss(child.pid))
            time.sleep(0.001)
            line = child.stdout.readline()
        done = json.loads(line)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert all(out > 0 for out, _ in done["reports"]), "the budget made the child swap"
    # The start RSS holds the state and the batch; what the steps add is their working set.
    allowed = ready["budget"] - ready["baseline"] + SLACK_BYTES
    assert highest - start <= allowed, (highest - start, allowed)
