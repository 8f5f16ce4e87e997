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

A CPU trace has no device planes: its ops are the host threads' thunk
events (op_events), concurrent across threads, busy their union.

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
import warnings

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


def _stats(event) -> dict:
  with warnings.catch_warnings():  # the bindings' types lack __module__
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
      return dict(event.stats)
    except (TypeError, ValueError):  # a stat the bindings cannot convert
      return {}


def _op_row(event) -> dict:
  stats = _stats(event)
  return {"name": str(stats.get("hlo_op") or event.name),
          "start_ns": event.start_ns, "duration_ns": event.duration_ns,
          "tf_op": str(stats.get("tf_op") or "")}


def op_events(path: str, device: int | None = None) -> dict:
  """Every HLO op execution in xplane `path`: {platform, ops: [{name,
  start_ns, duration_ns, tf_op}], busy_ns, span_ns}.

  GPU traces: the devices' "XLA Ops" lines (named by HLO instruction;
  `tf_op` is the op's JAX name scope where the trace carries it), busy and
  span from the kernels of the stream lines. CPU traces (no GPU plane):
  the host's thunk events, those with an `hlo_op` stat; their threads run
  ops concurrently, so busy is the union of the ops' intervals. `device`:
  only that GPU's plane (a trace of several GPUs running one SPMD program
  holds each op once per GPU)."""
  return _op_events(ProfileData.from_file(path), device)


def _op_events(data, device: int | None = None) -> dict:
  gpu_ops, stream_events, cpu_ops = [], [], []
  for plane in data.planes:
    if plane.name.startswith("/device:GPU") and (
        device is None or plane.name == f"/device:GPU:{device}"):
      for line in plane.lines:
        if line.name == "XLA Ops":
          gpu_ops.extend(_op_row(event) for event in line.events)
        elif line.name.startswith("Stream"):
          stream_events.extend(line.events)
    elif plane.name == "/host:CPU":
      for line in plane.lines:
        for event in line.events:
          if "hlo_op" in _stats(event):
            cpu_ops.append(dict(_op_row(event), tf_op=""))
  kernels = [(e.start_ns, e.start_ns + e.duration_ns) for e in stream_events]
  platform = "gpu" if gpu_ops or kernels else "cpu"
  if platform == "gpu":
    # A step run as CUDA graphs (XLA's command buffers) leaves the "XLA
    # Ops" line empty; its kernels may still name their op.
    ops = gpu_ops or [_op_row(e) for e in stream_events]
  else:
    ops = cpu_ops
    kernels = [(o["start_ns"], o["start_ns"] + o["duration_ns"]) for o in ops]
  span = (max(e for _, e in kernels) - min(s for s, _ in kernels)
          if kernels else 0)
  return {"platform": platform, "ops": ops, "busy_ns": _union_ns(kernels),
          "span_ns": span}


def summarize(path: str, top: int = 25) -> dict:
  """{ops, kernels, modules: [{name, ms, count}] (top `top` by time),
  busy_ns, span_ns, kernels_launched} of the GPU planes of xplane `path`
  (of its CPU ops where it has no GPU plane)."""
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
  cpu = not intervals and not any(sums.values())
  if cpu:  # a CPU trace: its ops are the host's thunk events
    for e in _op_events(data)["ops"]:
      sums["ops"][e["name"]][0] += e["duration_ns"]
      sums["ops"][e["name"]][1] += 1
      intervals.append((e["start_ns"], e["start_ns"] + e["duration_ns"]))
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
  out["kernels_launched"] = 0 if cpu else len(intervals)
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
