"""Throughput of ex2.approx.ftz.f32 (MUFU.EX2) and friends on this GPU, per SM per clock."""
import subprocess, threading, time, statistics
import torch, triton, triton.language as tl

@triton.jit
def k(x_ptr, ITERS: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    for _ in range(ITERS):
        if OP == 0:
            v = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1) * -0.5
        elif OP == 1:
            v = tl.inline_asm_elementwise("cvt.rmi.f32.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1) * -0.5 + 0.3
        elif OP == 2:
            v = v * -0.5 + 0.3
    tl.store(x_ptr + offs, v)

sm = torch.cuda.get_device_properties(0).multi_processor_count
clocks = []
stop = False
def poll():
    while not stop:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
        clocks.append(int(out.split()[0])); time.sleep(0.05)
th = threading.Thread(target=poll); th.start()
ITERS, BLOCK, NW = 1024, 4096, 8
x = torch.rand(sm * 32 * BLOCK, device="cuda") * -1
for op, name in ((0, "ex2.approx.ftz.f32"), (1, "cvt.rmi.f32.f32 (+FFMA)"), (2, "FFMA")):
    f = lambda: k[(x.numel() // BLOCK,)](x, ITERS=ITERS, OP=op, BLOCK=BLOCK, num_warps=NW)
    f(); torch.cuda.synchronize()
    clocks.clear()
    ms = triton.testing.do_bench(f, warmup=50, rep=500)
    mhz = statistics.median(clocks) if clocks else float("nan")
    per = x.numel() * ITERS / (ms * 1e-3) / sm / (mhz * 1e6)
    print(f"{name:28s} {ms:.3f} ms  at ~{mhz:.0f} MHz: {per:.1f} per SM per clock")
stop = True; th.join()
