"""A class-major later routing iteration, prototyped and read for Hopper on the CPU (scripts/kernel_report.py's
reading): a lead for the fused routing's redesign, not a served kernel, and not checked for parity.

One program takes BLOCK samples and one chunk of CHUNK input capsules (K = CHUNK·P product columns) and never forms
û. For each class j, the agreement is a product, A = g_j (BLOCK, D) @ W_jᵀ (D, K), and the logits b_ij = Σ_p u_ip·A_ip
another, against a 0/1 (K, max(CHUNK, 16)) matrix that sums each capsule's components; a first loop over the
classes keeps the softmax's running maximum and denominator in registers, a second recomputes the logits and adds
the weighted sum (c_j·u) @ W_j (K, D), the couplings spread back over the components by the transposed 0/1 matrix,
into the class's sums with atomics. From the repository root, with the GPU machines' Triton that the kernel report
installs:

    TRITON_CACHE_DIR=~/.cache/capsnet/kernel-report/compiled-3.6.0 \\
    PYTHONPATH=~/.cache/capsnet/kernel-report/triton-3.6.0 python scripts/experiments/class_major_iteration.py

Read on a 2-core AMD EPYC (AVX2), Triton 3.6.0, fp16 at batch 256 (bf16 reads the same), against today's later
pass (217 registers, 12.5%, ~140 warp-instructions per (sample, capsule), 87 µs modelled per iteration):

    BLOCK 64, CHUNK 16, 4 warps:  HGMMA, 196 registers, no spill, 2 CTAs (12.5%), 6 barriers a class,
                                  30 warp-instructions per (sample, capsule), 33 µs modelled per iteration
    the same, maxnreg=128:        25% occupancy but 416 B spilled, 41 warp-instructions, 23 µs
    BLOCK 32, CHUNK 16, 4 warps:  HMMA, 201 registers, 63 warp-instructions, 50 µs
    BLOCK 64, CHUNK 8, 4 warps:   HGMMA, 120 registers, no spill, 4 CTAs (25%), 44 warp-instructions, 24 µs
    BLOCK 64, CHUNK 4, 4 warps:   HGMMA, 87 registers, no spill, 5 CTAs (31%), 73 warp-instructions, 23 µs
    sums by reshape and tl.sum:   163-255 registers, 66-109 warp-instructions (the products are cheaper; read
                                  with an earlier version of this file)

At CHUNK 16 the TTGIR shows where the registers go: the agreement g_j·W_jᵀ is one wgmma of instruction shape
16×128×16 a warp, whose (64, 128) fp32 accumulator is 64 registers a thread at 4 warps, and u·A beside it in the same
layout in fp32 another 64 (neither u kept in fp32 alone, the agreement rounded to the input dtype nor block pointers
for W moved them; 8 warps left 184-186). Halving K (CHUNK 8, the logits' columns padded to the products' 16) halves
those tiles: the first shape here with no spill at 25% occupancy, at the price of more instructions per capsule. Two
such iterations model at about 48 µs, over the 40 µs a whole forward pass's routing is to take: the per-class
overhead (two loads, three small products and their layout changes a class, twice) is what is left to cut.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_report  # scripts/, beside this folder
from capsnet.models.config import preset


@triton.jit
def _later_iteration(primary_ptr, weight_ptr, agree_ptr, sums_ptr,
                     batch, squash_constant, stride_b, stride_c, stride_y, stride_x, grid_h, grid_w, columns,
                     P: tl.constexpr, CLASSES: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                     CHUNK: tl.constexpr):
    K: tl.constexpr = CHUNK * P
    # the logits' columns: a product's N and K are at least 16, so chunks under 16 capsules pad them with columns
    # that no component feeds and that spread back to none
    COLUMNS: tl.constexpr = 16 if CHUNK < 16 else CHUNK
    samples = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (BB,)
    live = samples < batch
    chunk = tl.program_id(1)
    ks = tl.arange(0, K)  # (K,): capsule ks // P of the chunk, component ks % P
    capsule = chunk * CHUNK + ks // P
    cells = grid_h * grid_w
    where = ((capsule // cells) * P + ks % P) * stride_c + (capsule % cells // grid_w) * stride_y \
        + (capsule % cells % grid_w) * stride_x
    raw = tl.load(primary_ptr + samples[:, None].to(tl.int64) * stride_b + where[None, :], mask=live[:, None],
                  other=0.0).to(tl.float32)  # (BB, K)
    raw3 = tl.reshape(raw, (BLOCK, CHUNK, P))
    norm2 = tl.sum(raw3 * raw3, axis=2)  # (BB, CHUNK)
    u = tl.reshape(raw3 * (tl.sqrt(norm2) / (squash_constant + norm2))[:, :, None], (BLOCK, K))  # squash
    u = u.to(weight_ptr.dtype.element_ty)
    dims = tl.arange(0, D)
    spread = ((ks[:, None] // P) == tl.arange(0, COLUMNS)[None, :]).to(weight_ptr.dtype.element_ty)  # (K, COLUMNS)
    top = tl.full((BLOCK, COLUMNS), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK, COLUMNS), tl.float32)
    for j in range(CLASSES):  # the softmax's maximum and denominator over the classes, online
        g = tl.load(agree_ptr + samples[:, None] * CLASSES * D + j * D + dims[None, :], mask=live[:, None],
                    other=0.0)  # (BB, D)
        wt = tl.load(weight_ptr + (j * D + dims[:, None]) * columns + chunk * K + ks[None, :])  # (D, K)
        agreement = tl.dot(g.to(wt.dtype), wt)  # (BB, K)
        logits = tl.dot((agreement * u.to(tl.float32)).to(wt.dtype), spread)  # (BB, COLUMNS)
        new_top = tl.maximum(top, logits)
        total = total * tl.exp(top - new_top) + tl.exp(logits - new_top)
        top = new_top
    for j in range(CLASSES):  # the couplings, and the weighted sums
        g = tl.load(agree_ptr + samples[:, None] * CLASSES * D + j * D + dims[None, :], mask=live[:, None],
                    other=0.0)
        wt = tl.load(weight_ptr + (j * D + dims[:, None]) * columns + chunk * K + ks[None, :])
        agreement = tl.dot(g.to(wt.dtype), wt)
        logits = tl.dot((agreement * u.to(tl.float32)).to(wt.dtype), spread)
        coupling = tl.exp(logits - top) / total  # (BB, COLUMNS)
        weighted = tl.dot(coupling.to(wt.dtype), tl.trans(spread)) * u.to(tl.float32)  # (BB, K)
        s = tl.dot(weighted.to(wt.dtype), tl.trans(wt))  # (BB, D)
        tl.atomic_add(sums_ptr + samples[:, None] * CLASSES * D + j * D + dims[None, :], s, mask=live[:, None],
                      sem="relaxed")


def read(dtype: torch.dtype, batch: int, block: int, chunk: int, warps: int, maxnreg: int | None = None) -> str:
    cfg = preset("paper")
    columns = cfg.num_primary_caps * cfg.primary_caps_dim
    primary = torch.zeros((batch, cfg.primary_caps_channels * cfg.primary_caps_dim, 6, 6), dtype=dtype).contiguous(
        memory_format=torch.channels_last)  # (B, 32·8, 6, 6)
    weight = torch.zeros((cfg.num_classes, cfg.digit_caps_dim, columns), dtype=dtype)  # (J, D, I·P): W_jᵀ
    agree = torch.zeros((batch, cfg.num_classes, cfg.digit_caps_dim))  # (B, J, D)
    sums = torch.zeros_like(agree)

    def launch():
        _later_iteration[(triton.cdiv(batch, block), cfg.num_primary_caps // chunk)](
            primary, weight, agree, sums, batch, cfg.squash_constant, *primary.stride(), 6, 6, columns,
            P=cfg.primary_caps_dim, CLASSES=cfg.num_classes, D=cfg.digit_caps_dim, BLOCK=block, CHUNK=chunk,
            num_warps=warps, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))

    (seen,) = kernel_report.launches_of(launch)
    _, lines = kernel_report.disassembled(seen.compiled)
    r = kernel_report.read(seen, str(dtype).removeprefix("torch."), batch)
    labels = {line[:-1]: i for i, line in enumerate(lines) if line.endswith(":")}
    loops = []  # the two class loops: each backward branch's body
    for i, line in enumerate(lines):
        target = kernel_report.BRANCH_TARGET.search(line) if kernel_report.opcode(line).startswith("BRA") else None
        if target and labels.get(target.group(1), i) < i and i - labels[target.group(1)] > 5:
            loops.append(sum(not x.endswith(":") for x in lines[labels[target.group(1)]:i + 1]))
    per_warp = r.sass_instructions + sum(loops) * (cfg.num_classes - 1)
    modelled = kernel_report.issue_time(math.prod(seen.grid), r.ctas_per_sm, warps, per_warp) + kernel_report.LAUNCH_S
    return (f"{r.precision} batch {batch}, BLOCK {block}, CHUNK {chunk}, {warps} warps, maxnreg {maxnreg}: "
            f"{r.loop.product if r.loop else '?'}, {r.registers} registers, {r.spill_bytes} B spilled, "
            f"{r.ctas_per_sm} CTAs ({r.occupancy:.1%}), {r.loop.barriers if r.loop else '?'} barriers a class, "
            f"{per_warp * warps / (block * chunk):.1f} warp-instructions per (sample, capsule), "
            f"{modelled * 1e6:.1f} µs modelled")


def main() -> None:
    kernel_report.stand_in_hopper()
    for dtype, block, chunk, warps, maxnreg in [(torch.float16, 64, 16, 4, None), (torch.float16, 64, 16, 4, 128),
                                                (torch.float16, 32, 16, 4, None), (torch.float16, 64, 8, 4, None),
                                                (torch.float16, 64, 4, 4, None), (torch.bfloat16, 64, 8, 4, None)]:
        print(read(dtype, 256, block, chunk, warps, maxnreg), flush=True)


if __name__ == "__main__":
    main()
