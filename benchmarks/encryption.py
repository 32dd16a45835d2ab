"""Cost of sealing the swap file: AEAD throughput per cipher, and step time with sealing on vs off.

Two measurements:

- ``aead``: seal and open throughput of each cipher on 1 MiB pieces, cycling over a 64 MiB
  working set so the data comes from memory, not cache: the raw ``encrypt_into`` /
  ``decrypt_into`` calls, and the whole ``Sealer`` path (staging buffer, tags, associated
  data) against an in-memory file (one extra memory copy each way).
- ``step``: one model trained under a budget that forces swapping (a fraction of its unmanaged
  tracked peak), with ``MemoryManager(encrypt_storage=True)`` and ``False`` side by side in the
  same process, interleaved round-robin after one profiling round; the median step time over
  the timed rounds, bytes moved, I/O thread busy time and stall. Gradients are compared
  between the variants on every round. With ``--keep-page-cache`` a second pair runs with
  ``drop_page_cache=False``: no write-back or cache drop per write, so the cipher's share shows
  plainly.

Run from the repository root::

    python -m benchmarks.encryption                       # mobilenet, budget 0.5, 7 rounds
    python -m benchmarks.encryption --quick               # CI-sized (< 30 s)
    python -m benchmarks.encryption --model gpt --budget 0.4 --keep-page-cache --out enc.jsonl
"""

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import cryptography
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from torch import nn

import vtensor
from benchmarks.common import (
    add_out,
    add_quick,
    add_repeats,
    describe,
    environment,
    repeats,
    tagged,
    write_json_lines,
)
from benchmarks.zoo import Workload, workloads
from vtensor.io.sealing import TAG_BYTES, Cipher, Piece, Sealer
from vtensor.io.tiers import buffer_at

MIB = 1 << 20
WORKING_SET = 64 * MIB


# -- AEAD throughput ------------------------------------------------------------------------------
def _best_gbps(run: Any, nbytes: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - begin)
    return nbytes / best / 1e9


def aead_throughput(cipher: Cipher, repeats: int) -> dict[str, Any]:
    """Seal/open GB/s of ``cipher`` on 1 MiB pieces over a 64 MiB working set."""
    count = WORKING_SET // MIB
    plain = torch.randint(0, 256, (WORKING_SET,), dtype=torch.uint8)
    back = torch.empty_like(plain)
    sealed = bytearray(count * (MIB + TAG_BYTES))
    aead = (AESGCM if cipher is Cipher.AES_256_GCM else ChaCha20Poly1305)(os.urandom(32))
    src, dst = buffer_at(plain.data_ptr(), WORKING_SET), buffer_at(back.data_ptr(), WORKING_SET)
    out = memoryview(sealed)
    nonce, aad = bytes(12), b"x" * 48  # a fixed nonce is fine for timing only

    def seal_raw() -> None:
        for i in range(count):
            aead.encrypt_into(
                nonce, src[i * MIB : (i + 1) * MIB], aad, out[i * (MIB + 16) :][: MIB + 16]
            )

    def open_raw() -> None:
        for i in range(count):
            aead.decrypt_into(
                nonce, out[i * (MIB + 16) :][: MIB + 16], aad, dst[i * MIB : (i + 1) * MIB]
            )

    sealer = Sealer(cipher)
    file = bytearray(WORKING_SET)

    def write(offset: int, views: list[memoryview]) -> None:
        for view in views:
            file[offset : offset + len(view)] = view
            offset += len(view)

    def read(offset: int, views: list[memoryview]) -> None:
        for view in views:
            view[:] = file[offset : offset + len(view)]
            offset += len(view)

    def pieces(base: int) -> list[Piece]:
        return [Piece(i * MIB, base + i * MIB, MIB, 1, i) for i in range(count)]

    row = {
        "cipher": cipher.value,
        "piece_bytes": MIB,
        "seal_gbps": _best_gbps(seal_raw, WORKING_SET, repeats),
        "open_gbps": _best_gbps(open_raw, WORKING_SET, repeats),
        "sealer_seal_gbps": _best_gbps(
            lambda: sealer.seal(pieces(plain.data_ptr()), write), WORKING_SET, repeats
        ),
        "sealer_open_gbps": _best_gbps(
            lambda: sealer.open(pieces(back.data_ptr()), read), WORKING_SET, repeats
        ),
    }
    open_raw()
    sealer.open(pieces(back.data_ptr()), read)
    assert torch.equal(plain, back), "sealing did not round-trip"
    sealer.close()
    return row


# -- step time ------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One manager configuration with its own model copy and optimizer."""

    name: str
    encrypt: bool
    drop_page_cache: bool
    model: nn.Module
    optimizer: torch.optim.Optimizer
    manager: vtensor.MemoryManager
    step_s: list[float] = field(default_factory=list)
    reports: list[vtensor.IterationReport] = field(default_factory=list)


def _step(v: Variant, w: Workload, x: torch.Tensor, y: torch.Tensor) -> float:
    v.optimizer.zero_grad(set_to_none=True)
    begin = time.perf_counter()
    with v.manager.step(v.model, v.optimizer, inputs=(x, y)):
        w.loss(v.model, x, y).backward()  # type: ignore[no-untyped-call]
    elapsed = time.perf_counter() - begin
    v.reports.append(v.manager.report())
    return elapsed


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def step_time(w: Workload, args: argparse.Namespace, storage_dir: str) -> list[dict[str, Any]]:
    """Median step time of ``w`` with sealing on and off, interleaved in this process."""
    torch.manual_seed(0)
    base = w.build()
    x, y = w.batch(0)
    with vtensor.MemoryManager("1TiB", storage_dir=storage_dir) as probe:
        with probe.step(base, inputs=(x, y)):
            w.loss(base, x, y).backward()  # type: ignore[no-untyped-call]
        peak = probe.report().peak_device_bytes
    base.zero_grad(set_to_none=True)
    budget = int(args.budget * peak)
    variants = []
    for drop in (True, False) if args.keep_page_cache else (True,):
        for encrypt in (False, True):
            model = w.build()
            model.load_state_dict(base.state_dict())
            name = ("sealed" if encrypt else "plain") + ("" if drop else ", page cache kept")
            manager = vtensor.MemoryManager(
                budget,
                chunk_bytes=args.chunk_bytes,
                storage_dir=storage_dir,
                encrypt_storage=encrypt,
                drop_page_cache=drop,
                offload_params=False,  # the activations' swap file, as the figures were taken
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            variants.append(Variant(name, encrypt, drop, model, opt, manager))
    identical = True
    for r in range(args.rounds + 1):  # round 0 profiles and plans: not timed
        x, y = w.batch(r)
        grads = []
        for v in variants if r % 2 == 0 else reversed(variants):
            elapsed = _step(v, w, x, y)
            if r > 0:
                v.step_s.append(elapsed)
            grads.append(_grads(v.model))
            v.optimizer.step()
        identical &= all(_same(grads[0], g) for g in grads[1:])
    rows = []
    for v in variants:
        v.manager.close()
        timed = v.reports[1:]
        rows.append(
            {
                "model": w.name,
                "model_description": w.describe,
                "variant": v.name,
                "encrypt_storage": v.encrypt,
                "drop_page_cache": v.drop_page_cache,
                "budget_bytes": budget,
                "unmanaged_peak_bytes": peak,
                "chunk_bytes": args.chunk_bytes,
                "rounds": len(v.step_s),
                "step_s_median": statistics.median(v.step_s),
                "step_s_all": v.step_s,
                "bytes_out_median": statistics.median(r.bytes_out for r in timed),
                "bytes_in_median": statistics.median(r.bytes_in for r in timed),
                "transfer_s_median": statistics.median(r.transfer_s for r in timed),
                "stall_s_median": statistics.median(r.stall_s for r in timed),
                "grads_identical_across_variants": identical,
            }
        )
    return rows


# -- output ---------------------------------------------------------------------------------------
def aead_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| cipher | seal GB/s | open GB/s | Sealer seal GB/s | Sealer open GB/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cipher']} | {r['seal_gbps']:.2f} | {r['open_gbps']:.2f} "
            f"| {r['sealer_seal_gbps']:.2f} | {r['sealer_open_gbps']:.2f} |"
        )
    return "\n".join(lines)


def step_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | median step s | vs plain | paired vs plain | MiB out | MiB in "
        "| I/O busy s | stall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain = {r["drop_page_cache"]: r for r in rows if not r["encrypt_storage"]}
    for r in rows:
        base = plain[r["drop_page_cache"]]
        ratio = r["step_s_median"] / base["step_s_median"] - 1
        # Median of per-round ratios: both steps of a pair ran back to back, so load drift on
        # a shared machine cancels better than in the ratio of medians.
        paired = statistics.median(
            a / b - 1 for a, b in zip(r["step_s_all"], base["step_s_all"], strict=True)
        )
        lines.append(
            f"| {r['variant']} | {r['step_s_median']:.3f} | {ratio:+.1%} | {paired:+.1%} "
            f"| {r['bytes_out_median'] / MIB:.0f} | {r['bytes_in_median'] / MIB:.0f} "
            f"| {r['transfer_s_median']:.3f} | {r['stall_s_median']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_quick(p, "small model, 5 rounds, 3 AEAD repeats")
    p.add_argument("--model", default="mobilenet", choices=["mobilenet", "resnet", "gpt"])
    p.add_argument("--budget", type=float, default=0.5, help="fraction of the unmanaged peak")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7; quick: 5)")
    p.add_argument("--chunk-bytes", type=int, default=MIB)
    p.add_argument(
        "--keep-page-cache", action="store_true", help="also run with the page cache kept"
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--storage-dir", default=None, help="directory of the swap files")
    add_repeats(p, "best-of repeats of each AEAD measurement", full=7, quick=3)
    add_out(p)
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 7
    torch.set_num_threads(args.threads)
    env = environment(cryptography=cryptography.__version__)
    print(describe(env), flush=True)
    aead_rows = [aead_throughput(c, repeats(args, full=7, quick=3)) for c in Cipher]
    print("\n## AEAD, 1 MiB pieces, 64 MiB working set (best of repeats)\n")
    print(aead_table(aead_rows) + "\n", flush=True)
    w = workloads(args.quick)[args.model]
    storage_dir = args.storage_dir or tempfile.gettempdir()
    rows = step_time(w, args, storage_dir)
    print(f"## step time: {w.describe}, budget {args.budget} of the unmanaged peak\n")
    print(step_table(rows) + "\n")
    same = rows[0]["grads_identical_across_variants"]
    print(f"gradients identical across variants on every round: {same}")
    write_json_lines(args.out, env, [*tagged("aead", aead_rows), *tagged("step", rows)])


if __name__ == "__main__":
    main()
