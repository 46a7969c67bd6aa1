"""Dynamic routing (Sabour et al. 2017) as Triton kernels that never write û to memory, one launch an iteration.

û_j|i = W_ij·u_i is (B, 1152, 10, 16): 737 KB an image in fp32, 189 MB at batch 256. The unfused graph writes it
once and reads it on every iteration, and its batched products over B·10 pairs of 1 × 1,152 by 1,152 × 16
matrices keep the tensor cores idle. Here each routing iteration is one launch over the input capsules that
recomputes û tile by tile on chip, from u (B × 1152 × 8) and W (1152 × 8 × 160, read from L2 by every
program), with a tensor-core product per capsule:

    iteration k, program (sample block, capsule slice):
        for each capsule i of the slice:
            k = 0:  u_i = squash(primary capsule i)            (BB, P)      the PrimaryCaps squash, in registers,
                                                                            kept (B, I·P) in the products' dtype
                    two capsules a product, c = 1/J (uniform)               (1/(J+1) leaky)
            k > 0:  u_i as the first pass kept it
                    c = softmax_j(û_i · g)                                  exp2, no shift where bounded
            û_i = u_i @ W_i                                    (BB, J'·D)   fp32 accumulation
            acc += c · û_i                                     (BB, J'·D)
        s += acc                                               atomics into one fp32 buffer (B, J'·D)
        the block's last program to finish (a counter per block): v = squash(s), then
            g = g + v (sabour, leaky), v (su): the next iteration's agreement vector        (B, J'·D)
            or, in the last iteration, the poses and their lengths
        and s and the counter zeroed for the next iteration (and the next forward pass)

The softmax over the classes is shift-invariant; its shift by the maximum logit only keeps exp in range, and costs
the later passes a reduction across warps per capsule (the classes of a sample are spread over the warpgroups).
|b_ij| ≤ ‖W_ij‖·|g_j| (|u_i| < 1), so where the weights bound every logit far inside exp2's range (logits_bounded),
the kernels take exp2 of the logits unshifted: one reduction a capsule, the sum. Weights that do not bound them are
routed with the shifted softmax (SHIFTED), a reduction more a capsule.

The logits b_k = Σ_{m<k} û·v_m are linear in û, so they are one dot product with the running sum of the poses:
nothing of size (B, I, J) is kept between iterations. There is no partial-sum buffer and no reduce kernel: the sums
meet in L2 through atomics, and the block that completes them squashes them. A forward pass is `routing_iterations`
launches (3 in the paper's model) and nothing else, whatever the batch. The squash and the agreement vector are in
the finishing block's epilogue rather than the next launch's prologue: there, beside the later iterations' (BB, J'·D)
votes, sums and agreement, they spilled registers at the 128 a thread that 16 warps an SM leave.

Inputs are fp32, fp16 or bf16 (the compute dtype of the convolutions that produce them); every product
accumulates in fp32, and softmax, squash and the sums run in fp32. In fp32 the products run in IEEE fp32 (no TF32),
so the result matches `capsnet.models.capsnet.route` to rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from capsnet.runtime.fused_support import MIN_DOT, fused_unsupported_reason, next_power_of_2
from capsnet.models.config import CapsNetConfig
from capsnet.models.capsnet import CapsNet

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

LOG2E = tl.constexpr(1.4426950408889634)
# |logits| up to 2^64 apart in exp2: fp32's range (2^±126) holds every weight and their sum over the classes
EXP2_HEADROOM = 64.0
WANTED_PROGRAM_WARPS = 4  # the width of the programs that `programs_wanted` counts


@dataclass(frozen=True)
class LaunchPlan:
    """How one batch is cut: `block` samples by `slices` capsule slices of `per_slice` capsules, one program each,
    of `warps` warps, its capsule loop software-pipelined `stages` deep."""

    block: int
    slices: int
    per_slice: int
    warps: int = 4
    stages: int = 2


def launch_plan(batch: int, capsules: int, programs_wanted: int, dtype: torch.dtype = torch.float32) -> LaunchPlan:
    """Plans that scripts/kernel_report.py reads for Hopper with no spill and 16 warps an SM (25% occupancy). A later
    pass holds (block, J'·D) fp32 sums, votes and agreement, so its registers a thread fall as more warps share them:
    tensor-core dtypes take blocks of 16 samples on 8 warps, and past batch 128 of 64 on 16 (a wgmma tile); fp32's
    FFMA products blocks of 16 on 8 warps, and past 16 samples of 32 on 16. The capsule loop runs unpipelined (one
    stage): fewer instructions and registers in every plan read but fp32's 16-sample one, which needs two stages to
    fit 128 registers.

    `programs_wanted` counts programs of 4 warps (4 an SM on a GPU, 16 warps); a plan of wider programs launches
    proportionally fewer, so that one wave of them fills the GPU, and slices round down rather than add a thin wave.
    """
    tensor_cores = dtype != torch.float32
    if tensor_cores:
        block, warps = (MIN_DOT, 8) if batch <= 128 else (64, 16)
    else:
        block, warps = (MIN_DOT, 8) if batch <= MIN_DOT else (32, 16)
    stages = 1 if tensor_cores or block > MIN_DOT else 2
    blocks = -(-batch // block)
    programs = max(1, programs_wanted * WANTED_PROGRAM_WARPS // warps)
    slices = max(1, min(capsules, programs // blocks))
    per_slice = -(-capsules // slices)
    return LaunchPlan(block, -(-capsules // per_slice), per_slice, warps=warps, stages=stages)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32: the interpreter's own conversion truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


# the sizes that vary with the batch are not specialised on: one compiled kernel an iteration serves every plan
@triton.jit(do_not_specialize=["batch", "per_slice", "slices"])
def _routing_pass(
    primary_ptr, squashed_ptr, weight_ptr, sums_ptr, agree_ptr, done_ptr, poses_ptr, lengths_ptr,
    batch, capsules, per_slice, slices, squash_constant, first_scale,
    stride_b, stride_c, stride_y, stride_x, GRID_H: tl.constexpr, GRID_W: tl.constexpr,
    DIM_IN: tl.constexpr, DIM_IN_PADDED: tl.constexpr, CAPSULE_WIDTH: tl.constexpr, CLASSES: tl.constexpr,
    CLASSES_PADDED: tl.constexpr, DIM_OUT: tl.constexpr, BLOCK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    LEAKY: tl.constexpr, REPLACE: tl.constexpr, SHIFTED: tl.constexpr, IEEE: tl.constexpr,
    ROUNDED_IN_FP32: tl.constexpr,
):
    """One routing iteration over one slice of the input capsules for one block of samples: Σ_i c_ij û_j|i
    (BLOCK, CLASSES_PADDED·DIM_OUT) added into sums_ptr; the block's last program squashes the sums into the next
    iteration's agreement vector (or the poses and their lengths) and zeroes them and its counter. The FIRST
    squashes the primary capsules into squashed_ptr (B, I·P) for the later ones, in the products' dtype."""
    OUT: tl.constexpr = CLASSES_PADDED * DIM_OUT
    block_id = tl.program_id(0)
    slice_id = tl.program_id(1)
    samples = block_id * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    live = samples < batch
    comps = tl.arange(0, DIM_IN_PADDED)  # (P',)
    outs = tl.arange(0, OUT)  # (J'·D,)
    classes = tl.arange(0, CLASSES_PADDED)  # (J',)
    real = outs < CLASSES * DIM_OUT  # (J'·D,): the padded classes' columns are zero, never read nor added
    squashed_rows = samples[:, None].to(tl.int64) * capsules * DIM_IN  # (BLOCK, 1) in the squashed capsules
    rows = samples[:, None].to(tl.int64) * OUT + outs[None, :]  # (BLOCK, J'·D) in sums and agreement
    if not FIRST:
        agree = tl.load(agree_ptr + rows, mask=live[:, None], other=0.0)
    acc = tl.zeros((BLOCK, OUT), dtype=tl.float32)
    first = slice_id * per_slice
    last = tl.minimum(first + per_slice, capsules)
    if FIRST:  # the uniform coupling: s = Σ_i û_i, so GROUP capsules fill a product's K = P' without padding
        GROUP: tl.constexpr = DIM_IN_PADDED // CAPSULE_WIDTH
        member = comps // CAPSULE_WIDTH  # (P',): capsule i + member, component comps % CAPSULE_WIDTH
        component = comps % CAPSULE_WIDTH
        CELLS: tl.constexpr = GRID_H * GRID_W  # a model's grid: its divisions are by constants
        for i in range(first, last, GROUP):
            capsule = i + member  # (P',)
            kept = (component < DIM_IN) & (capsule < last)  # (P',)
            # primary capsule i = (channel c, y, x) is conv channels c·P .. c·P+P-1 at (y, x): any strides
            cell = capsule % CELLS
            where = ((capsule // CELLS) * DIM_IN + component) * stride_c + (cell // GRID_W) * stride_y \
                + (cell % GRID_W) * stride_x  # (P',)
            raw = tl.load(primary_ptr + samples[:, None].to(tl.int64) * stride_b + where[None, :],
                          mask=live[:, None] & kept[None, :], other=0.0).to(tl.float32)  # (BLOCK, P')
            raw3 = tl.reshape(raw, (BLOCK, GROUP, CAPSULE_WIDTH))
            norm2 = tl.sum(raw3 * raw3, axis=2)  # (BLOCK, GROUP)
            u = tl.reshape(raw3 * (tl.sqrt(norm2) / (squash_constant + norm2))[:, :, None], (BLOCK, DIM_IN_PADDED))
            if ROUNDED_IN_FP32:
                u = _round_to_bf16(u)  # the interpreter's own conversion to bf16 would truncate
            tl.store(squashed_ptr + squashed_rows + (capsule * DIM_IN + component)[None, :], u,
                     mask=live[:, None] & kept[None, :])  # in the products' dtype: as the products round it
            w = tl.load(weight_ptr + (capsule * DIM_IN + component)[:, None] * OUT + outs[None, :],
                        mask=kept[:, None] & real[None, :], other=0.0)  # (P', J'·D): W_i of each capsule, stacked
            acc += _votes(u, w, IEEE, ROUNDED_IN_FP32)  # (BLOCK, J'·D): Σ of the group's û_i
    else:
        agree *= LOG2E  # logits in log2 units: the softmax's exponentials are exp2, without a multiply each
        in_mask = live[:, None] & (comps[None, :] < DIM_IN)  # (BLOCK, P')
        for i in range(first, last):
            u = tl.load(squashed_ptr + squashed_rows + i * DIM_IN + comps[None, :], mask=in_mask,
                        other=0.0)  # (BLOCK, P'): squashed by the first pass
            # rows past P are the product's zero padding: masked, so they cost no memory traffic
            w = tl.load(weight_ptr + i * DIM_IN * OUT + comps[:, None] * OUT + outs[None, :],
                        mask=(comps[:, None] < DIM_IN) & real[None, :], other=0.0)  # (P', J'·D)
            u_hat = _votes(u, w, IEEE, ROUNDED_IN_FP32)  # (BLOCK, J'·D)
            votes = tl.reshape(u_hat, (BLOCK, CLASSES_PADDED, DIM_OUT))  # (BLOCK, J', D)
            logits = tl.sum(votes * tl.reshape(agree, (BLOCK, CLASSES_PADDED, DIM_OUT)), axis=2)  # (BLOCK, J')
            if SHIFTED:  # logits that could overflow exp2: shifted by their maximum, over the classes
                logits = tl.where(classes[None, :] < CLASSES, logits, float("-inf"))
                top = tl.max(logits, axis=1)  # (BLOCK,)
                if LEAKY:
                    top = tl.maximum(top, 0.0)  # the extra "none of these" logit is 0
                weights = tl.math.exp2(logits - top[:, None])  # (BLOCK, J')
                total = tl.sum(weights, axis=1)
                if LEAKY:
                    total += tl.math.exp2(-top)
            else:
                # |logits| are bounded well inside exp2's range (logits_bounded), and softmax does not change
                # with a shift: no maximum over the classes. A padded class's votes and agreement are 0,
                # so its logit is 0 and its weight exactly 1: taken off the total, as the leaky logit 0 is added
                weights = tl.math.exp2(logits)  # (BLOCK, J')
                total = tl.sum(weights, axis=1) - (CLASSES_PADDED - CLASSES - LEAKY)
            coupling = weights * (1.0 / total)[:, None]  # (BLOCK, J'): one division a sample
            acc += tl.reshape(votes * coupling[:, :, None], (BLOCK, OUT))
    if FIRST:
        acc *= first_scale  # the uniform coupling
    # the epilogue by halves of the classes: the whole (BLOCK, J'·D) tile's addresses spilled registers
    HALF: tl.constexpr = OUT // 2
    low, high = tl.split(tl.permute(tl.reshape(acc, (BLOCK, 2, HALF)), (0, 2, 1)))  # (BLOCK, J'·D / 2) each
    _add_half(sums_ptr, low, samples, live, 0, OUT, HALF, CLASSES * DIM_OUT)
    _add_half(sums_ptr, high, samples, live, HALF, OUT, HALF, CLASSES * DIM_OUT)
    tl.debug_barrier()  # every thread's sums added before the block's counter counts this program
    done = tl.atomic_add(done_ptr + block_id, 1, sem="acq_rel")
    if done == slices - 1:  # the block's last program
        for offset in tl.static_range(0, OUT, HALF):
            _finish_half(sums_ptr, agree_ptr, poses_ptr, lengths_ptr, samples, live, squash_constant, offset, OUT, HALF,
                         CLASSES, DIM_OUT, BLOCK, FIRST, LAST, REPLACE)
        tl.store(done_ptr + block_id, 0)  # zero again for the next iteration, as _finish_half leaves the sums


@triton.jit
def _votes(u, w, IEEE: tl.constexpr, ROUNDED_IN_FP32: tl.constexpr):
    """u (BLOCK, P') @ w (P', J'·D) with fp32 sums: IEEE fp32 products in fp32, the input dtype's otherwise."""
    if IEEE:
        return tl.dot(u, w, input_precision="ieee")
    elif ROUNDED_IN_FP32:
        return tl.dot(_round_to_bf16(u.to(tl.float32)), w.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(u.to(w.dtype), w)


@triton.jit
def _add_half(sums_ptr, part, samples, live, OFFSET: tl.constexpr, OUT: tl.constexpr, HALF: tl.constexpr,
              REAL: tl.constexpr):
    """part (BLOCK, HALF) added with atomics into columns OFFSET.. of the sums (B, OUT), those before REAL."""
    cols = OFFSET + tl.arange(0, HALF)  # (HALF,)
    at = samples[:, None].to(tl.int64) * OUT + cols[None, :]
    tl.atomic_add(sums_ptr + at, part, mask=live[:, None] & (cols < REAL)[None, :], sem="relaxed")


@triton.jit
def _finish_half(sums_ptr, agree_ptr, poses_ptr, lengths_ptr, samples, live, squash_constant,
                 OFFSET: tl.constexpr, OUT: tl.constexpr, HALF: tl.constexpr, CLASSES: tl.constexpr,
                 DIM_OUT: tl.constexpr, BLOCK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                 REPLACE: tl.constexpr):
    """v = squash(s) for the classes in columns OFFSET.. of a block's complete sums, which it zeroes: the next
    iteration's agreement vector, or in the LAST the poses and their lengths."""
    cols = OFFSET + tl.arange(0, HALF)  # (HALF,)
    at = samples[:, None].to(tl.int64) * OUT + cols[None, :]  # (BLOCK, HALF)
    s = tl.load(sums_ptr + at, mask=live[:, None], other=0.0, cache_modifier=".cg")  # (BLOCK, HALF), from L2
    tl.store(sums_ptr + at, tl.zeros((BLOCK, HALF), dtype=tl.float32), mask=live[:, None])
    s3 = tl.reshape(s, (BLOCK, HALF // DIM_OUT, DIM_OUT))  # (BLOCK, J'/2, D)
    norm2 = tl.sum(s3 * s3, axis=2)  # (BLOCK, J'/2)
    v = tl.reshape(s3 * (tl.sqrt(norm2) / (squash_constant + norm2))[:, :, None], (BLOCK, HALF))  # squash
    if LAST:
        tl.store(poses_ptr + samples[:, None] * CLASSES * DIM_OUT + cols[None, :], v,
                 mask=live[:, None] & (cols < CLASSES * DIM_OUT)[None, :])
        classes = OFFSET // DIM_OUT + tl.arange(0, HALF // DIM_OUT)  # (J'/2,)
        # |v| = |s|² / (c + |s|²): the length of the squashed vector, without a second square root
        tl.store(lengths_ptr + samples[:, None] * CLASSES + classes[None, :], norm2 / (squash_constant + norm2),
                 mask=live[:, None] & (classes < CLASSES)[None, :])
    else:
        if not (FIRST or REPLACE):  # the logits add up over the iterations, so do the agreement vectors
            v += tl.load(agree_ptr + at, mask=live[:, None], other=0.0)
        tl.store(agree_ptr + at, v, mask=live[:, None])


def _pass_work(args: dict) -> tuple[int, int, int, int]:
    weight = args["weight_ptr"]
    blocks = triton.cdiv(args["batch"], args["BLOCK"])
    programs = blocks * args["slices"]
    out = args["CLASSES"] * args["DIM_OUT"]  # the columns read and added: the padded classes' are masked off
    per_capsule = out * args["DIM_IN"] * weight.element_size()
    group = args["DIM_IN_PADDED"] // args["CAPSULE_WIDTH"] if args["FIRST"] else 1  # capsules a trip
    # and each program adds its (BLOCK, J·D) fp32 sums into L2 with atomics: a read and a write there
    return args["BLOCK"], group, triton.cdiv(args["per_slice"], group), \
        programs * (args["per_slice"] * per_capsule + args["BLOCK"] * out * 8)


# What one program of each kernel covers, for scripts/kernel_report.py's reading of the compiled code: samples,
# input capsules a trip of its loop covers, trips, and the bytes all its programs move through L2 again
KERNEL_WORK = {"_routing_pass": _pass_work}


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read when triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class FusedDigitCaps:
    """DigitCaps with its routing on the fused kernels, for the primary convolution's raw output: squash of the
    primary capsules, û, every routing iteration, the poses and their lengths. W is packed once, its classes
    zero-padded to the tiles the kernels read, in the dtype of the primary convolution (fp32, fp16 or bf16).

    The iterations' sums and the sample blocks' counters are scratch kept per batch size and device, zero between
    forward passes (the last launch zeroes what the pass used), so a pass launches its kernels and nothing else: a
    CUDA graph of it replays them alone. A batch size's scratch serves one forward pass at a time."""

    def __init__(self, config: CapsNetConfig, weight: torch.Tensor, dtype: torch.dtype, programs_wanted: int):
        reason = fused_unsupported_reason(config)
        if reason:
            raise ValueError(f"the fused routing kernels cannot run this model: {reason}")
        self.config = config
        self.dtype = dtype
        self.programs_wanted = programs_wanted
        self.dim_in_padded = max(MIN_DOT, triton.next_power_of_2(config.primary_caps_dim))
        self.classes_padded = triton.next_power_of_2(config.num_classes)
        self.dim_out = config.digit_caps_dim
        capsules, dim_in = config.num_primary_caps, config.primary_caps_dim
        packed = torch.zeros((capsules, dim_in, self.classes_padded, self.dim_out), dtype=dtype,
                             device=weight.device)  # (I, P, J', D)
        packed[:, :, :config.num_classes] = weight.detach().view(
            capsules, dim_in, config.num_classes, self.dim_out).to(dtype)  # (I, P, J, D)
        self.weight = packed
        self.out = self.classes_padded * self.dim_out
        # Triton's interpreter multiplies bf16 operands wrongly (it reads their bits as another type) and truncates
        # fp32 to bf16; there the operands are rounded to the nearest bf16 and multiplied in fp32, which is exact for
        # a product of two bf16 values, so the CPU checks the tensor cores' arithmetic up to the order of the sums
        self.rounded_in_fp32 = dtype == torch.bfloat16 and interpreted()
        self.shift_free = logits_bounded(packed, config)
        self.scratch: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}

    def _scratch(self, batch: int, blocks: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """An iteration's sums and the agreement vectors (B, J'·D), a counter per sample block, and the squashed
        primary capsules (B, I·P), for one batch size: the sums and counters zero between iterations, as each
        block's last program leaves them."""
        key = (batch, device)
        if key not in self.scratch:
            self.scratch[key] = (
                torch.zeros((batch, self.out), dtype=torch.float32, device=device),  # (B, J'·D)
                torch.zeros((batch, self.out), dtype=torch.float32, device=device),  # (B, J'·D)
                torch.zeros((triton.cdiv(batch, MIN_DOT),), dtype=torch.int32, device=device),  # blocks ≥ 16 samples
                torch.empty((batch, self.config.num_primary_caps * self.config.primary_caps_dim), dtype=self.dtype,
                            device=device),  # (B, I·P)
            )
        sums, agree, done, squashed = self.scratch[key]
        assert done.numel() >= blocks
        return sums, agree, done, squashed

    def __call__(self, primary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """primary (B, channels·P, H, W), the primary convolution's output before the squash, any strides ->
        poses (B, J, D) and probabilities (B, J), float32."""
        cfg = self.config
        batch, _, grid_h, grid_w = primary.shape
        capsules = cfg.primary_caps_channels * grid_h * grid_w
        if capsules != cfg.num_primary_caps:
            raise ValueError(f"{capsules} primary capsules, the weights are for {cfg.num_primary_caps}")
        plan = launch_plan(batch, capsules, self.programs_wanted, self.dtype)
        device = primary.device
        blocks = triton.cdiv(batch, plan.block)
        sums, agree, done, squashed = self._scratch(batch, blocks, device)
        poses = torch.empty((batch, cfg.num_classes, self.dim_out), dtype=torch.float32, device=device)  # (B, J, D)
        lengths = torch.empty((batch, cfg.num_classes), dtype=torch.float32, device=device)  # (B, J)
        leaky = cfg.routing == "leaky"
        stride_b, stride_c, stride_y, stride_x = primary.stride()
        try:
            for iteration in range(cfg.routing_iterations):
                _routing_pass[(blocks, plan.slices)](
                    primary, squashed, self.weight, sums, agree, done, poses, lengths,
                    batch, capsules, plan.per_slice, plan.slices, cfg.squash_constant, 1.0 / (cfg.num_classes + leaky),
                    stride_b, stride_c, stride_y, stride_x, GRID_H=grid_h, GRID_W=grid_w,
                    DIM_IN=cfg.primary_caps_dim, DIM_IN_PADDED=self.dim_in_padded,
                    CAPSULE_WIDTH=next_power_of_2(cfg.primary_caps_dim), CLASSES=cfg.num_classes,
                    CLASSES_PADDED=self.classes_padded, DIM_OUT=self.dim_out, BLOCK=plan.block,
                    FIRST=iteration == 0, LAST=iteration == cfg.routing_iterations - 1, LEAKY=leaky,
                    REPLACE=cfg.routing == "su", SHIFTED=not self.shift_free,
                    IEEE=self.dtype == torch.float32, ROUNDED_IN_FP32=self.rounded_in_fp32,
                    num_warps=plan.warps, num_stages=plan.stages,
                )
        except BaseException:
            del self.scratch[(batch, device)]  # a pass cut short may leave sums behind
            raise
        return poses, lengths


def logits_bounded(packed: torch.Tensor, config: CapsNetConfig) -> bool:
    """Whether no input can give a routing logit b_ij = û_j|i · g_j outside ±EXP2_HEADROOM in log2 units, so that
    the softmax over the classes needs no shift by its maximum. |û_j|i| ≤ ‖W_ij‖ as a squashed |u_i| < 1 (the
    Frobenius norm bounds the operator norm), and g_j is a sum of at most iterations − 1 poses of length < 1 (su:
    the last one). CapsNet initialises ‖W_ij‖ at about 0.1, some 200 times inside the bound for 3 iterations."""
    poses = 1 if config.routing == "su" else max(1, config.routing_iterations - 1)
    votes = torch.linalg.vector_norm(packed.float(), dim=(1, 3)).amax().item()  # max over (i, j) of ‖W_ij‖
    return votes * poses * LOG2E.value <= EXP2_HEADROOM


def default_programs(device: torch.device) -> int:
    """Programs of 4 warps per routing pass: four per streaming multiprocessor on a GPU (16 warps, as many as the
    routing passes' registers let an SM hold: launch_plan); any number runs under the interpreter, which is
    sequential."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


class FusedOutputs(NamedTuple):
    probabilities: torch.Tensor  # (B, J)
    poses: torch.Tensor  # (B, J, D)
    reconstruction: torch.Tensor | None  # (B, C·H·W), where asked for


class FusedCapsNet:
    """The CapsNet forward pass for serving on a GPU: Conv1 and PrimaryCaps in `dtype` through cuDNN on channels-last
    tensors, then the PrimaryCaps squash and all of DigitCaps in the fused kernels, then the decoder in fp32 where
    the reconstruction is asked for. In fp32 nothing runs in TF32: the caller runs it under `strict_fp32()`."""

    def __init__(self, model: CapsNet, dtype: torch.dtype, reconstruction: bool, programs_wanted: int):
        self.model = model.eval()
        self.dtype = dtype
        self.reconstruction = reconstruction
        for conv in (model.conv1, model.primary_caps.conv):
            conv.to(dtype=dtype)
            conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
        self.digit_caps = FusedDigitCaps(model.config, model.digit_caps.weight, dtype, programs_wanted)

    def __call__(self, images: torch.Tensor) -> FusedOutputs:
        model = self.model
        x = model.normalised(images).to(self.dtype).contiguous(memory_format=torch.channels_last)  # (B, C, H, W)
        features = torch.relu_(model.conv1(x))  # (B, 256, 20, 20)
        primary = model.primary_caps.conv(features)  # (B, 32·8, 6, 6), channels-last, not yet squashed
        poses, probabilities = self.digit_caps(primary)  # (B, J, D), (B, J)
        reconstruction = model.decoder(poses, probabilities.argmax(dim=1)) if self.reconstruction else None
        return FusedOutputs(probabilities, poses, reconstruction)
