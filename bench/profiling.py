"""One call profiled on the host (cProfile: the 15 functions with the most time of their own) and
on the device (torch's profiler: the 10 kernels and ops with the most device time of their own)."""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path


def profiled(call, cuda: bool) -> dict:
    """`call()` once under both profilers: {host_tottime_ms, device_self_ms} as [name, ms] rows."""
    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as traced:
        host.runcall(call)
    stats = pstats.Stats(host).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]
    events = sorted(traced.key_averages(), key=lambda e: -e.self_device_time_total)[:10]
    return {
        "host_tottime_ms": [
            [f"{Path(f).name}:{line}({name})", round(1e3 * row[2], 2)]
            for (f, line, name), row in top
        ],
        "device_self_ms": [[e.key, round(e.self_device_time_total / 1e3, 2)] for e in events],
    }
