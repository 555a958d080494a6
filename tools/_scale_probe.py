"""One-off (not in the repo): the single-GPU op's kernel time as the batch shrinks, the
quantity KCP's per-rank ratio reduces to where no document crosses a rank."""
import statistics, sys, torch
sys.path.insert(0, ".")
from cake_ops.bench.shapes import Shape, make_inputs
from cake_ops.bench.kcp import _single_step
from cake_ops.bench.timing import Timer
dev = torch.device("cuda")
timer = Timer(dev)
for name, docs, H, HV in (("64x4096 h2", (4096,) * 64, 2, 6), ("32x4096 h2", (4096,) * 32, 2, 6), ("16x4096 h2", (4096,) * 16, 2, 6),
                          ("2x131072 h16", (131072,) * 2, 16, 48), ("2x65536 h16", (65536,) * 2, 16, 48), ("1x65536 h16", (65536,), 16, 48)):
    inp = make_inputs(Shape(name, docs, H, HV), dev, "mamba", 0)
    step = _single_step(inp)
    for _ in range(2): step()
    timer.sync()
    ms = statistics.median(timer.kernel_ms(step, 1)[0] for _ in range(3))
    print(f"{name:14s} tokens {sum(docs):7d}  fwdbwd kernel_ms {ms:8.3f}  per 1k tokens {1000 * ms / sum(docs):.4f}", flush=True)
    del inp, step
