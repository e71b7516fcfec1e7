import time, numpy as np, shmbuffer as sb, torch
from benchmarks.device_copy import SCHEMA, rows, fill
buf = sb.ReplayBuffer(SCHEMA, 1_000_000, name="qq-dev3")
try:
    fill(buf, 1_000_000)
    dev = sb.DeviceReplay(buf, "cpu", seed=1, refresher=False)
    b = dev.sample(256); t = buf.take(b.index.numpy())
    for k in SCHEMA.names: assert np.array_equal(np.asarray(t[k]), b[k].numpy()), k
    print(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split("\n")[0])
    K=20000
    for r in range(3):
        T0=time.perf_counter()
        for _ in range(K): buf.sample(256).to("cpu")
        print("host", (time.perf_counter()-T0)/K*1e6, end=" ")
        T0=time.perf_counter()
        for _ in range(K): dev.sample(256)
        print("dev", (time.perf_counter()-T0)/K*1e6)
    dev.close()
finally:
    buf.close(); buf.unlink()
