"""The fused routing kernels on a GPU, for tuning them: parity against the model and export's emulation, a sweep
of launch plans (samples per block, warps, pipeline stages, programs per SM) of the routing alone inside CUDA
graphs at batches 1, 256 and 1024, the engine in each precision at 1/32/256/1024, a profile of the bf16 engine, and
torch.compile's bf16 time beside it. About three minutes on an H200. On the GPU machine, from a package tree of the
checkout on PYTHONPATH (as scripts/gpu_check.sh makes one):

    python3 scripts/experiments/fused_routing_probe.py
"""

import itertools
import time

import torch
from torch.profiler import ProfilerActivity, profile

from capsnet.models.config import preset
from capsnet.models.capsnet import CapsNet
from capsnet.runtime import fused_routing as fr
from capsnet.runtime.reduced_precision import convolutions_in, routing_inputs_in
from capsnet.runtime.torch_runner import strict_fp32

dev = torch.device("cuda", 0)
with profile(activities=[ProfilerActivity.CUDA]):  # CUPTI started before any graph is captured
    torch.ones(1, device=dev).add_(1)
    torch.cuda.synchronize()
sms = torch.cuda.get_device_properties(dev).multi_processor_count
print("device", torch.cuda.get_device_name(0), "sms", sms, "torch", torch.__version__, flush=True)
cfg = preset("paper")


def model(seed=0):
    torch.manual_seed(seed)
    m = CapsNet(cfg).to(dev).eval()
    with torch.no_grad():
        m.primary_caps.conv.weight.mul_(8.0)
        m.digit_caps.weight.normal_(0, 0.05)
    return m


def timed(fn, n=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def graphed(fn):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    return g.replay


t0 = time.time()
m = model()
x = torch.rand(1024, 1, 28, 28, device=dev)
with torch.inference_mode():
    with strict_fp32():
        ref = m(x[:64])
    # 1. parity
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        eng = fr.FusedCapsNet(model(), dt, reconstruction=True, programs_wanted=4 * sms)
        with strict_fp32(dt == torch.float32):
            out = eng(x[:64])
        if dt == torch.float32:
            print(
                "parity fp32",
                {
                    k: (getattr(out, k) - getattr(ref, k)).abs().max().item()
                    for k in ("probabilities", "poses", "reconstruction")
                },
                flush=True,
            )
        else:
            em = model()
            convolutions_in(em, name, emulate=True)
            routing_inputs_in(em, name)
            with strict_fp32():
                e = em(x[:64])
            print(
                "parity",
                name,
                "vs emulation",
                (out.probabilities - e.probabilities).abs().max().item(),
                "emulation vs fp32",
                (e.probabilities - ref.probabilities).abs().max().item(),
                "engine vs fp32",
                (out.probabilities - ref.probabilities).abs().max().item(),
                flush=True,
            )
    print("parity done", round(time.time() - t0, 1), flush=True)
    # 2. launch-plan sweep of the routing alone, bf16, inside CUDA graphs
    prim = {
        b: m.primary_caps.conv(torch.relu(m.conv1(x[:b])))
        .to(torch.bfloat16)
        .contiguous(memory_format=torch.channels_last)
        for b in (1, 256, 1024)
    }
    dc = fr.FusedDigitCaps(cfg, m.digit_caps.weight, torch.bfloat16, 4 * sms)
    orig = fr.launch_plan
    best = {}
    for batch in (1, 256, 1024):
        rows = []
        for block, warps, stages, per_sm in itertools.product((16, 32, 64), (4, 8, 16), (1, 2, 3), (2, 4, 8)):
            if batch == 1 and block > 16:
                continue

            def plan(b, caps, programs, dtype, block=block, warps=warps, stages=stages, per_sm=per_sm):
                blocks = -(-b // block)
                slices = max(1, min(caps, -(-(per_sm * sms) // blocks)))
                per = -(-caps // slices)
                return fr.LaunchPlan(block, -(-caps // per), per, warps, stages)

            fr.launch_plan = plan
            try:
                replay = graphed(lambda batch=batch: dc(prim[batch]))
                ms = timed(replay, 20)
                rows.append((ms, block, warps, stages, per_sm))
            except Exception as err:
                print("plan failed", batch, block, warps, stages, per_sm, repr(err)[:200], flush=True)
        fr.launch_plan = orig
        rows.sort()
        best[batch] = rows[:5]
        print(
            "sweep batch",
            batch,
            "best",
            rows[:5],
            "worst",
            rows[-2:],
            "default-like",
            [r for r in rows if r[4] == 4 and r[3] == 2][:4],
            flush=True,
        )
    print("sweep done", round(time.time() - t0, 1), flush=True)
    # 3. engines, device-resident, CUDA graphs per batch
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        eng = fr.FusedCapsNet(model(), dt, reconstruction=True, programs_wanted=4 * sms)
        res = {}
        for batch in (1, 32, 256, 1024):
            xb = x[:batch].clone()
            with strict_fp32(dt == torch.float32):
                replay = graphed(lambda eng=eng, xb=xb: eng(xb))
            res[batch] = round(timed(replay), 4)
        print("fused engine", name, res, flush=True)
    res = {}
    for batch in (1, 256):
        xb = x[:batch].clone()
        pm = model()
        replay = graphed(lambda pm=pm, xb=xb: pm(xb))
        res[batch] = round(timed(replay), 4)
    print("torch model graphed fp32 (defaults)", res, flush=True)
    # 4. profile fused bf16 at 1 and 256
    eng = fr.FusedCapsNet(model(), torch.bfloat16, reconstruction=True, programs_wanted=4 * sms)
    for batch in (1, 256):
        xb = x[:batch].clone()
        replay = graphed(lambda xb=xb: eng(xb))
        replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                replay()
            torch.cuda.synchronize()
        print(
            f"profile fused bf16 batch {batch}\n"
            + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70),
            flush=True,
        )
print("probe done", round(time.time() - t0, 1), flush=True)
# 5. torch.compile reference (bf16 autocast, reduce-overhead) at 1 and 256
t1 = time.time()
cm = torch.compile(model(), mode="reduce-overhead", dynamic=False)
res = {}
with torch.inference_mode():
    for batch in (1, 256):
        xb = x[:batch].clone()

        def f(xb=xb):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return cm(xb)

        res[batch] = round(timed(f), 4)
print("compile bf16 autocast", res, "compile seconds", round(time.time() - t1, 1), flush=True)
