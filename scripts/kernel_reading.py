"""The fused GPU engine's Triton kernels compiled for Hopper (sm_90a) on a CPU machine, and read there: registers,
spills and shared memory from the cubin, the capsule loop's instructions from the SASS, occupancy and waves on an
H100/H200, and a time modelled from those counts (MODEL). scripts/kernel_report.py writes the report from these
readings, in a process whose Triton is TRITON_RELEASE.

The engine's own launch code (capsnet.runtime.fused_routing.FusedDigitCaps) runs on CPU tensors of the served
shapes, dtypes and strides, with a stand-in driver that reports a Hopper GPU and Triton's launch turned into a
compile: whatever kernels, launch plans and grids the engine picks are what is read, at programs_wanted as on a
132-SM GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import json
import math
import os
import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TRITON_RELEASE = "3.6.0"  # the GPU machines' release
BATCHES = (1, 32, 256, 1024)
PRECISIONS = ("fp32", "fp16", "bf16")

# Hopper (compute capability 9.0), the same on an H100 SXM and an H200
SMS = 132
REGISTERS_PER_SM = 65_536
REGISTER_UNIT = 256  # registers are given to a warp in units of 256 (8 per thread)
MAX_REGISTERS_PER_THREAD = 255
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_CTA = 1024  # the system's own shared memory per resident CTA
SHARED_UNIT = 128
MAX_CTAS_PER_SM = 32
MAX_WARPS_PER_SM = 64
SCHEDULERS_PER_SM = 4

# The time model, for an H200 (its SMs are an H100's, with more and faster memory)
CLOCK_HZ = 1.98e9  # the boost clock of both
DRAM_BYTES_PER_S = 4.8e12  # H200 HBM3e (an H100 SXM: 3.35e12)
L2_BYTES_PER_S = 7.0e12  # an H100's L2 read bandwidth as microbenchmarks report it; the H200's L2 is the same
MMA_SYNC_FLOPS = 660e12  # mma.sync (HMMA) at about 2/3 of the 989 TFLOP/s dense fp16/bf16 that wgmma reaches
WGMMA_FLOPS = 989e12
HIDING_WARPS = 4  # eligible warps a scheduler needs to issue every cycle: fewer, and it idles in proportion
LAUNCH_S = 1.5e-6  # a kernel's start and drain, back to back inside a CUDA graph
MODEL = f"""\
Per launch, the slowest of four bounds, plus {LAUNCH_S * 1e6:g} µs for the kernel's start and drain in a CUDA graph:

- **issue**: each warp runs the SASS outside the loop once and the loop body once per trip; an SM's
  {SCHEDULERS_PER_SM} schedulers issue one warp-instruction a cycle each when each holds ≥ {HIDING_WARPS} resident
  warps (fewer: proportionally less, as nothing hides the latencies), at {CLOCK_HZ / 1e9:g} GHz; the launch takes
  each full wave, then the last partial one, on the busiest SM;
- **tensor cores**: the loop's HMMA (mma.sync, its shape read from the SASS: HMMA.16816 is 4,096 FLOP a warp) at
  {MMA_SYNC_FLOPS / 1e12:g} TFLOP/s, HGMMA (wgmma, 64×N×K a warpgroup) at {WGMMA_FLOPS / 1e12:g} TFLOP/s, over all SMs;
- **DRAM**: every tensor argument read or written once, at {DRAM_BYTES_PER_S / 1e12:g} TB/s (an H200);
- **L2**: what every program reads again from L2 (the packed weights, once per sample block and loop over the
  classes) and the sums it adds into L2 with atomics (each a read and a write there), at
  {L2_BYTES_PER_S / 1e12:g} TB/s.

An optimistic model: it counts no stall of a warp that has the scheduler to itself beyond the latency hiding above,
no bank conflict and no dependency inside a product chain. Its value is in comparing kernels, and in a floor: a
kernel modelled slow will not be fast.
"""


@dataclasses.dataclass
class Loop:
    instructions: int
    barriers: int
    product: str
    products: int
    product_flops: int  # FLOP a warp in one trip
    shared_accesses: int
    local_accesses: int


@dataclasses.dataclass
class KernelReading:
    precision: str
    batch: int
    kernel: str
    variant: str
    grid: tuple[int, ...]
    warps: int
    stages: int
    registers: int
    spill_bytes: int
    shared_bytes: int
    ctas_per_sm: int
    occupancy: float
    limited_by: str
    waves: float
    sass_instructions: int
    loop: Loop | None
    samples_per_program: int
    capsules_per_trip: int
    trips: int
    per_sample_capsule: float | None
    modelled_s: float
    bound: str
    launches: int = 1
    logits: str = "bounded"  # the weights the engine was built with: see WEIGHT_SCALES



def triton_cache_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("CAPSNET_KERNEL_REPORT_CACHE", Path(base) / "capsnet" / "kernel-report"))



# ---------------------------------------------------------------- compiling what the engine launches

def stand_in_hopper():
    """Triton's active driver replaced by one that reports an sm_90 GPU: the compiler targets Hopper, nothing runs."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver

    class HopperStandIn(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("nothing is launched")

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("nothing is timed")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(HopperStandIn())


@dataclasses.dataclass
class Launch:
    kernel: str
    arguments: dict
    grid: tuple[int, ...]
    compiled: Any  # triton's CompiledKernel


def launches_of(call) -> list[Launch]:
    """Runs call() with every Triton launch compiled instead (JITFunction.run with warmup): what it would launch."""
    from triton.runtime.jit import JITFunction

    seen: list[Launch] = []
    original = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        compiled = original(self, *args, grid=grid, warmup=True, **kwargs)
        bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                                  if k in inspect.signature(self.fn).parameters})
        arguments = dict(bound.arguments)
        grid = grid(arguments) if callable(grid) else grid
        seen.append(Launch(self.fn.__name__, arguments, tuple(int(g) for g in grid), compiled))
        return compiled

    JITFunction.run = compile_instead
    try:
        call()
    finally:
        JITFunction.run = original
    return seen


def tool(name: str) -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resources(cubin: Path) -> dict[str, int]:
    out = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not found:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{out}")
    return dict(zip(("registers", "stack", "shared", "local"), map(int, found.groups())))


SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?P<text>[^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?`?\(?(\.L_x_\d+)\)?")


def sass(cubin: Path) -> list[str]:
    """The kernel's SASS, one instruction a line, with its labels as lines of their own."""
    out = subprocess.run([tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in out.splitlines():
        label = LABEL.match(line)
        if label:
            lines.append(label.group(1) + ":")
        elif instruction := SASS_LINE.search(line):
            lines.append(instruction.group("text").strip())
    return lines


def opcode(instruction: str) -> str:
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def product_loop(lines: list[str]) -> Loop | None:
    """The largest loop (a backward branch's span) that holds the kernel's product instructions."""
    where = {line[:-1]: i for i, line in enumerate(lines) if line.endswith(":")}
    best = None
    for i, line in enumerate(lines):
        target = BRANCH_TARGET.search(line) if opcode(line).startswith("BRA") else None
        if not target or where.get(target.group(1), i) >= i:
            continue
        body = [x for x in lines[where[target.group(1)]:i + 1] if not x.endswith(":")]
        ops = [opcode(x) for x in body]
        counts = {kind: sum(o.startswith(kind) for o in ops) for kind in ("HGMMA", "HMMA", "FFMA")}
        product = next((kind for kind in ("HGMMA", "HMMA", "FFMA") if counts[kind]), None)
        if product is None or (best is not None and len(body) <= best.instructions):
            continue
        best = Loop(instructions=sum(o != "NOP" for o in ops),
                    barriers=sum(o.startswith("BAR.SYNC") or o == "BAR" for o in ops),
                    product=product, products=counts[product], product_flops=sum(map(mma_flops, ops)),
                    shared_accesses=sum(o.startswith(("LDS", "STS", "LDSM", "STSM")) for o in ops),
                    local_accesses=sum(o.startswith(("LDL", "STL")) for o in ops))
    return best


def occupancy(registers: int, shared: int, warps: int) -> tuple[int, str]:
    """CTAs a Hopper SM holds at once, and what limits them."""
    per_warp = math.ceil(registers * 32 / REGISTER_UNIT) * REGISTER_UNIT
    limits = {
        "registers": (REGISTERS_PER_SM // per_warp) // warps if registers else MAX_CTAS_PER_SM,
        "shared memory": SHARED_PER_SM // (math.ceil(shared / SHARED_UNIT) * SHARED_UNIT + SHARED_RESERVED_PER_CTA),
        "warps": MAX_WARPS_PER_SM // warps,
        "CTAs": MAX_CTAS_PER_SM,
    }
    kind = min(limits, key=lambda k: limits[k])
    return limits[kind], kind


def work_of(kernel: str, arguments: dict) -> tuple[int, int, int, int]:
    """Samples a program routes, capsules one trip of its loop covers, trips, and the bytes all programs move through
    L2 again, for the engine's kernels (fused_routing.KERNEL_WORK)."""
    from capsnet.runtime.fused_routing import KERNEL_WORK
    describe = KERNEL_WORK.get(kernel)
    return describe(arguments) if describe else (0, 0, 1, 0)


def disassembled(compiled) -> tuple[dict[str, int], list[str]]:
    """cuobjdump's resource usage and nvdisasm's SASS of a compiled kernel, kept by its hash (each tool takes a
    second or two to start)."""
    kept = triton_cache_home() / f"sass-{TRITON_RELEASE}" / f"{compiled.hash}.json"
    if kept.exists():
        use, lines = json.loads(kept.read_text())
        return use, lines
    with tempfile.TemporaryDirectory() as workdir:
        cubin = Path(workdir) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        use, lines = resources(cubin), sass(cubin)
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps([use, lines]))
    return use, lines


def read(launch: Launch, precision: str, batch: int) -> KernelReading:
    compiled = launch.compiled
    use, lines = disassembled(compiled)
    loop = product_loop(lines)
    warps = compiled.metadata.num_warps
    shared = max(compiled.metadata.shared, use["shared"])
    ctas, limited_by = occupancy(use["registers"], shared, warps)
    programs = math.prod(launch.grid)
    waves = programs / (SMS * max(ctas, 1))
    samples, capsules, trips, l2_bytes = work_of(launch.kernel, launch.arguments)
    instructions = sum(not x.endswith(":") and opcode(x) != "NOP" for x in lines)
    per_warp = instructions + (loop.instructions * (trips - 1) if loop else 0)
    per_sample_capsule = (loop.instructions * warps / (samples * capsules)) if loop and samples and capsules else None

    bounds = {"issue": issue_time(programs, ctas, warps, per_warp)}
    if loop and loop.product_flops:
        flops = loop.product_flops * warps * trips * programs
        bounds["tensor cores"] = flops / (MMA_SYNC_FLOPS if loop.product == "HMMA" else WGMMA_FLOPS)
    import torch
    dram = sum(v.numel() * v.element_size() for v in launch.arguments.values() if isinstance(v, torch.Tensor))
    bounds["DRAM"] = dram / DRAM_BYTES_PER_S
    bounds["L2"] = l2_bytes / L2_BYTES_PER_S
    bound = max(bounds, key=lambda k: bounds[k])
    variant = ", ".join(f"{k}" for k, v in launch.arguments.items() if k.isupper() and v is True) or "—"
    return KernelReading(
        precision=precision, batch=batch, kernel=launch.kernel, variant=variant, grid=launch.grid, warps=warps,
        stages=compiled.metadata.num_stages, registers=use["registers"],
        spill_bytes=use["stack"] + use["local"], shared_bytes=shared, ctas_per_sm=ctas,
        occupancy=ctas * warps / MAX_WARPS_PER_SM, limited_by=limited_by, waves=waves,
        sass_instructions=instructions, loop=loop, samples_per_program=samples, capsules_per_trip=capsules,
        trips=trips, per_sample_capsule=per_sample_capsule, modelled_s=bounds[bound] + LAUNCH_S, bound=bound)


def issue_time(programs: int, ctas: int, warps: int, per_warp: int) -> float:
    """Full waves of `ctas` CTAs on every SM, then the last, partial one on the busiest SM."""
    full, left = divmod(programs, SMS * ctas)
    last = -(-left // SMS)

    def wave(resident_ctas: int) -> float:
        resident = resident_ctas * warps
        rate = SCHEDULERS_PER_SM * min(1.0, resident / SCHEDULERS_PER_SM / HIDING_WARPS)  # warp-instr a cycle
        return resident * per_warp / rate / CLOCK_HZ

    return full * wave(ctas) + (wave(last) if last else 0.0)


def mma_flops(operation: str) -> int:
    """FLOP a warp of one tensor-core opcode: HMMA.MNK (HMMA.16816: m16n8k16), or its quarter of a warpgroup's
    HGMMA.64xNxK."""
    if shape := re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", operation):
        return 2 * math.prod(map(int, shape.groups())) // 4
    if shape := re.match(r"HMMA\.(16)(8)(8|16)\b", operation):
        return 2 * math.prod(map(int, shape.groups()))
    return 0


# The engine picks its softmax from the weights (fused_routing.logits_bounded): weights of CapsNet's initial scale
# bound every logit inside exp2's range (the softmax unshifted, as trained models run), and weights of 10 everywhere
# do not (the softmax shifted by its maximum). Both are served plans: each is read.
WEIGHT_SCALES = {"bounded": 0.01, "unbounded": 10.0}


def engine_readings() -> list[KernelReading]:
    import torch

    stand_in_hopper()
    from capsnet.runtime.fused_routing import DTYPES, FusedDigitCaps
    from capsnet.models.config import preset

    config = preset("paper")
    planned = []
    for (logits, scale), precision in itertools.product(WEIGHT_SCALES.items(), PRECISIONS):
        weight = torch.full((config.num_primary_caps * config.primary_caps_dim,
                             config.num_classes * config.digit_caps_dim), scale)
        engine = FusedDigitCaps(config, weight.view(-1), DTYPES[precision], programs_wanted=4 * SMS)
        assert engine.shift_free == (logits == "bounded"), logits
        for batch in BATCHES:
            channels = config.primary_caps_channels * config.primary_caps_dim
            primary = torch.zeros((batch, channels, 6, 6), dtype=DTYPES[precision]).contiguous(
                memory_format=torch.channels_last)  # (B, 32·8, 6, 6): the primary convolution's output
            seen: dict[str, Launch] = {}
            repeats: dict[str, int] = {}
            for launch in launches_of(functools.partial(engine, primary)):
                seen.setdefault(launch.compiled.hash, launch)  # the same kernel launched again: read once
                repeats[launch.compiled.hash] = repeats.get(launch.compiled.hash, 0) + 1
            planned += [(launch, precision, batch, repeats[key], logits) for key, launch in seen.items()]
    unique = {launch.compiled.hash: launch.compiled for launch, *_ in planned}  # a kernel several plans share
    with ThreadPoolExecutor(max_workers=4) as pool:  # the tools mostly wait on their own start
        list(pool.map(disassembled, unique.values()))
    readings = [read(launch, precision, batch) for launch, precision, batch, *_ in planned]
    return [dataclasses.replace(r, launches=p[3], modelled_s=r.modelled_s * p[3], logits=p[4])
            for r, p in zip(readings, planned)]
