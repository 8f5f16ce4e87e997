"""Where a GPU step's time goes: device time per XLA op from a profiler trace.

`device_op_times(fn)` runs `fn` (which must block until its device work is
done) under `jax.profiler.trace` and sums, per name, the device events of
the trace's GPU planes:

  ops      the "XLA Ops" line: one event per HLO op (a fusion, a custom call
           such as a Pallas kernel, a copy), named by the HLO instruction
  kernels  the stream lines: one event per CUDA kernel launched
  modules  the "XLA Modules" line: one event per executable run
  cuda_api the host planes' CUDA API calls (cuLaunchKernel, cuGraphLaunch,
           synchronisations), by count: whether a step is launched kernel by
           kernel or as CUDA graphs (XLA's command buffers)

Names repeated across layers (fusion.12 in a while body runs once per
iteration) sum over every run. `busy_ns` is the union of the kernel events'
intervals: the device time in which some kernel ran; `span_ns` the first
start to the last end. Their difference is the device's idle time inside
the measured window: launch gaps, host syncs, dispatch.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax
from jax.profiler import ProfileData


def _union_ns(intervals) -> int:
  total, end = 0, None
  for start, stop in sorted(intervals):
    if end is None or start > end:
      total += stop - start
      end = stop
    elif stop > end:
      total += stop - end
      end = stop
  return total


def summarize(path: str, top: int = 25) -> dict:
  """{ops, kernels, modules: [{name, ms, count}] (top `top` by time),
  busy_ns, span_ns, kernels_launched} of the GPU planes of xplane `path`."""
  data = ProfileData.from_file(path)
  sums = {kind: collections.defaultdict(lambda: [0, 0])
          for kind in ("ops", "kernels", "modules")}
  intervals = []
  api = collections.defaultdict(lambda: [0, 0])
  for plane in data.planes:
    if plane.name.startswith("/host:"):  # CUDA API calls: launches, syncs
      for line in plane.lines:
        for event in line.events:
          if event.name.startswith("cu"):
            api[event.name][0] += event.duration_ns
            api[event.name][1] += 1
      continue
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if line.name == "XLA Ops":
        kind = "ops"
      elif line.name == "XLA Modules":
        kind = "modules"
      elif line.name.startswith("Stream"):
        kind = "kernels"
      else:
        continue
      for event in line.events:
        entry = sums[kind][event.name]
        entry[0] += event.duration_ns
        entry[1] += 1
        if kind == "kernels":
          intervals.append((event.start_ns,
                            event.start_ns + event.duration_ns))
  out = {kind: [{"name": name, "ms": ns / 1e6, "count": count}
                for name, (ns, count) in sorted(table.items(),
                                                key=lambda kv: -kv[1][0])
                ][:top]
         for kind, table in sums.items()}
  out["cuda_api"] = [{"name": name, "ms": ns / 1e6, "count": count}
                     for name, (ns, count) in sorted(api.items(),
                                                     key=lambda kv: -kv[1][1])
                     ][:top]
  out["busy_ns"] = _union_ns(intervals)
  out["span_ns"] = (max(e for _, e in intervals) - min(s for s, _ in intervals)
                    if intervals else 0)
  out["kernels_launched"] = len(intervals)
  return out


def device_op_times(fn, top: int = 25, trace_dir: str | None = None) -> dict:
  """summarize() of a trace of one call of `fn` (warm it up beforehand)."""
  trace_dir = trace_dir or tempfile.mkdtemp(prefix="m2jax_trace_")
  with jax.profiler.trace(trace_dir):
    fn()
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                           recursive=True), key=os.path.getmtime)
  if not paths:
    raise RuntimeError(f"jax.profiler.trace wrote no xplane in {trace_dir}")
  return summarize(paths[-1], top)


def print_summary(summary: dict, label: str = "", rows: int = 15) -> None:
  busy, span = summary["busy_ns"], summary["span_ns"]
  print(f"{label}: {summary['kernels_launched']} kernels, busy "
        f"{busy / 1e6:.3f} ms of a {span / 1e6:.3f} ms span")
  for entry in (summary["ops"] or summary["kernels"])[:rows]:
    print(f"  {entry['ms']:9.3f} ms {entry['count']:6d}x  {entry['name']}")
  print("  host CUDA API calls: " + ", ".join(
      f"{e['name']} {e['count']}x {e['ms']:.2f} ms"
      for e in summary["cuda_api"][:6]))
