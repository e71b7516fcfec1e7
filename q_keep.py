from benchmarks.device_copy import case_keep_up
r = case_keep_up(1_000_000, "cpu", "perfk", 4.0, 5e5)
print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
