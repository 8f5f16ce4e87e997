r"""Where a train step's device time goes, by category, from a profiler trace.

  python -m benchmarks.train_profile_table RUN.ops.json [MORE.ops.json ...]
  python -m benchmarks.train_profile_table TRACE_DIR

prints the markdown table of benchmarks/notes/train.md: ms per step and %
per category, one column pair per run, then the largest ops of "other".
experiments.bench_train --profile_dir writes both inputs: the per-op JSON
(small: it comes back from the GPU machine) and the trace directory (the
xplane and the compiled step's HLO text, `*.hlo.txt`).

Every device op (benchmarks.profile.op_events: the GPU's "XLA Ops" line, or
the CPU's thunk events) is named by its HLO instruction. The compiled HLO
text gives each instruction its opcodes (a fusion's fused ones included)
and the JAX name scope it came from (metadata op_name, e.g.
"jit(train_step)/transpose(jvp(Transformer))/layers_3/moe/dispatch/gather").
Flax names every module call (layers_3, attn, moe, ffn_norm, ...); the MoE's
router, dispatch, combine, expert and statistics functions and RoPE carry
named scopes of their own (m2jax/model/moe.py, layers.py). Without HLO text
the trace's own `tf_op` stat (the same op_name, on GPU traces) is used, and
without either the op's kind (its opcodes, or its name).

Categories (CATEGORIES): a pure data-movement op (copies, transposes,
casts, slices: DATA_MOVEMENT) is "copies" wherever it came from; otherwise
the scope decides, and ops with no scope fall back to their kind. "idle" is
the span of the traced steps minus the time in which some op ran.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys

import jax

from benchmarks import profile as profile_lib

FORMAT = "m2jax.train_profile/1"

# (key, label) in table order; "idle" is computed, not summed from ops.
CATEGORIES = (
    ("attention", "attention"),
    ("expert_matmuls", "expert matmuls (dense: FFN)"),
    ("dispatch", "dispatch: sort/gather/scatter"),
    ("router", "router and routing stats"),
    ("norms_rope", "norms and RoPE"),
    ("lm_head_ce", "lm_head and cross-entropy"),
    ("embedding", "embedding"),
    ("optimizer", "optimizer update"),
    ("communication", "collectives (several GPUs)"),
    ("copies", "copies/transposes/casts"),
    ("other", "other"),
    ("idle", "idle"),
)
CATEGORY_KEYS = tuple(k for k, _ in CATEGORIES)

# Opcodes that only move or re-type data; a fusion made of nothing else is a
# copy. TRIVIAL ones carry no work of their own.
TRIVIAL = frozenset({"parameter", "constant", "tuple", "get-tuple-element",
                     "bitcast", "fusion"})
DATA_MOVEMENT = frozenset({
    "copy", "copy-start", "copy-done", "transpose", "reshape", "broadcast",
    "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad",
    "reverse", "convert", "iota"}) | TRIVIAL
# Collectives (and the async pairs XLA splits them into): "communication",
# wherever they came from.
COLLECTIVES = frozenset({
    "all-gather", "all-gather-start", "all-gather-done", "reduce-scatter",
    "all-reduce", "all-reduce-start", "all-reduce-done", "all-to-all",
    "ragged-all-to-all", "collective-permute", "collective-permute-start",
    "collective-permute-done"})
# Whose scope names a fusion: the first of these kinds it contains.
_ANCHORS = ("custom-call", "dot", "convolution", "sort", "scatter", "gather",
            "reduce-window", "reduce")

# Names of ops, for when nothing else is known (XLA's fusion names say what
# they hold: "loop_transpose_fusion", "copy_bitcast_fusion.3", "gemm_fusion").
_NAME_KINDS = (("communication", ("nccl", "all-gather", "all_gather",
                                   "reduce-scatter", "reduce_scatter",
                                   "all-to-all", "all-reduce")),
               ("dispatch", ("sort", "gather", "scatter")),
               ("copies", ("copy", "transpose", "convert")))

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def parse_hlo(text: str) -> dict[str, dict]:
  """{instruction name: {"kind", "opcodes", "scope"}} of compiled HLO text.

  "opcodes" holds the instruction's opcode and those of every computation
  it calls (a fusion's body), "kind" its opcode (a custom call's target
  after a colon), "scope" the op_name of its anchor: the first custom call,
  dot, sort, scatter, gather or reduce inside it, else its own."""
  computations: dict[str, list] = {}
  current = None
  for line in text.splitlines():
    if current is None or not line.startswith(" "):
      m = _COMPUTATION.match(line)
      if m and not line.startswith("HloModule"):
        current = computations.setdefault(m.group(1), [])
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    rest = " " + m.group(2)
    opcode = _OPCODE.search(rest)
    scope = _OP_NAME.search(rest)
    target = _TARGET.search(rest)
    current.append({
        "name": m.group(1),
        "opcode": opcode.group(1) if opcode else "",
        "scope": (scope.group(1).replace("\\'", "'") if scope else ""),
        "target": target.group(1) if target else "",
        "calls": _CALLS.findall(rest)})

  def flatten(instr, seen):
    out = [instr]
    for name in instr["calls"]:
      if name in computations and name not in seen:
        seen.add(name)
        for inner in computations[name]:
          out.extend(flatten(inner, seen))
    return out

  ops = {}
  for instructions in computations.values():
    for instr in instructions:
      body = flatten(instr, set())
      anchor = next((i for kind in _ANCHORS for i in body
                     if i["opcode"] == kind and i["scope"]), None)
      scope = (anchor or instr)["scope"] or next(
          (i["scope"] for i in body if i["scope"]), "")
      kind = instr["opcode"]
      if instr["target"]:
        kind += ":" + instr["target"]
      ops[instr["name"]] = {"kind": kind, "scope": scope,
                            "opcodes": sorted({i["opcode"] for i in body})}
  return ops


def scope_category(scope: str) -> str | None:
  """The category a JAX name scope says, or None where it says nothing (an
  op XLA made up, named "sort" or "reduce_sum", or an argument's name)."""
  parts = scope.split(";")[0].split("/")
  if not parts[0].startswith(("jit(", "pjit(")):
    return None
  names = set(parts[1:])
  if "rope" in names or any(p.endswith("_norm") for p in parts):
    return "norms_rope"  # attn_norm, ffn_norm, q_norm, final_norm, ...
  # The MoE's functions (m2jax/model/moe.py), wherever they are called.
  if "experts" in names:
    return "expert_matmuls"
  if names & {"router", "routing_stats"}:
    return "router"
  if names & {"dispatch", "combine"}:
    return "dispatch"
  if "moe" in names:
    return "dispatch"  # the exchange, casts and reshapes of the tokens
  if "mlp" in names:  # the dense FFN of the dense baseline
    return "expert_matmuls"
  if "attn" in names:
    return "attention"
  if any(p.startswith("Transformer.head") for p in parts):
    return "lm_head_ce"
  if any(p.startswith("Transformer.embed") for p in parts):
    return "embedding"
  if any("Transformer" in p for p in parts):
    return "other"  # residual adds, the MTP input projection
  if any(p.startswith(("jvp(", "transpose(")) for p in parts[1:]):
    return "lm_head_ce"  # differentiated outside the model: the losses
  return "optimizer"  # the step after the gradient: optax, the bias update


def kind_category(opcodes, name: str = "") -> str:
  """The category of an op without a scope, from its opcodes or name."""
  ops = set(opcodes)
  if ops:
    if ops <= DATA_MOVEMENT:
      return "copies"
    if ops & {"sort", "gather", "scatter"}:
      return "dispatch"
    return "other"
  lowered = name.lower()
  for category, words in _NAME_KINDS:
    if any(w in lowered for w in words):
      return category
  return "other"


def categorize(op: dict) -> str:
  """The category of one op row ({"name", "scope", "opcodes"})."""
  opcodes = op.get("opcodes") or []
  if set(opcodes) & COLLECTIVES:
    return "communication"
  if opcodes and set(opcodes) <= DATA_MOVEMENT:
    return "copies"
  return (scope_category(op.get("scope") or "")
          or kind_category(opcodes, op["name"]))


def find_files(trace_dir: str) -> tuple[str, str | None]:
  """(newest xplane, newest HLO text or None) under `trace_dir`."""
  newest = lambda pattern: sorted(
      glob.glob(os.path.join(trace_dir, "**", pattern), recursive=True),
      key=os.path.getmtime)
  xplanes, hlos = newest("*.xplane.pb"), newest("*.hlo.txt")
  if not xplanes:
    raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
  return xplanes[-1], (hlos[-1] if hlos else None)


def summarize_trace(xplane: str, steps: int, hlo_text: str | None = None, *,
                    label: str = "", max_ops: int = 2000,
                    device: int | None = None) -> dict:
  """The per-op summary (FORMAT) of a trace of `steps` train steps.

  Op rows hold ms and count per step, the scope, opcodes and category; the
  `max_ops` slowest ops are kept and the rest summed into one row per
  category (so the JSON stays small and the totals exact). `device`: one
  GPU's ops of a trace of several."""
  hlo = parse_hlo(hlo_text) if hlo_text else {}
  events = profile_lib.op_events(xplane, device)
  rows: dict[str, dict] = {}
  for e in events["ops"]:
    row = rows.get(e["name"])
    if row is None:
      info = hlo.get(e["name"], {})
      row = rows[e["name"]] = {
          "name": e["name"], "ns": 0, "count": 0,
          "scope": info.get("scope") or e.get("tf_op", ""),
          "opcodes": info.get("opcodes", []),
          "kind": info.get("kind", "")}
    row["ns"] += e["duration_ns"]
    row["count"] += 1
  ops = []
  for row in sorted(rows.values(), key=lambda r: -r["ns"]):
    ops.append({"name": row["name"], "ms": row["ns"] / 1e6 / steps,
                "count": row["count"] / steps, "category": categorize(row),
                "kind": row["kind"], "scope": row["scope"][:200],
                "opcodes": row["opcodes"]})
  kept, rest = ops[:max_ops], collections.defaultdict(lambda: [0.0, 0.0, 0])
  for op in ops[max_ops:]:
    r = rest[op["category"]]
    r[0] += op["ms"]
    r[1] += op["count"]
    r[2] += 1
  for category, (ms, count, n) in sorted(rest.items()):
    kept.append({"name": f"({n} smaller ops)", "ms": ms, "count": count,
                 "category": category, "kind": "", "scope": "",
                 "opcodes": [], "merged": True})
  return {"format": FORMAT, "label": label, "platform": events["platform"],
          "steps": steps, "busy_ms": events["busy_ns"] / 1e6 / steps,
          "span_ms": events["span_ns"] / 1e6 / steps,
          "hlo_ops_known": sum(1 for r in rows.values() if r["opcodes"]),
          "ops": kept}


def capture(step, state, batches, *, steps: int, trace_dir: str,
            hlo_text: str, label: str = "", device: int | None = None):
  """Trace `steps` calls of a warm, compiled `step(state, batch) -> (state,
  out)` into `trace_dir` (with the step's HLO text and a profile_meta.json,
  so `load(trace_dir)` can rebuild the summary). Returns (the last state,
  the summary)."""
  os.makedirs(trace_dir, exist_ok=True)
  with open(os.path.join(trace_dir, "step.hlo.txt"), "w",
            encoding="utf-8") as f:
    f.write(hlo_text)
  with open(os.path.join(trace_dir, "profile_meta.json"), "w",
            encoding="utf-8") as f:
    json.dump({"label": label, "steps": steps, "device": device}, f)
  jax.block_until_ready(state)
  with jax.profiler.trace(trace_dir):
    for i in range(steps):
      state, _ = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
  xplane, _ = find_files(trace_dir)
  return state, summarize_trace(xplane, steps, hlo_text, label=label,
                                device=device)


def category_ms(summary: dict) -> dict[str, float]:
  """ms per step of every category; ops are categorised again (a JSON
  saved by an older categoriser reads with today's rules), idle is the
  span less the busy time."""
  out = dict.fromkeys(CATEGORY_KEYS, 0.0)
  for op in summary["ops"]:
    category = op["category"] if op.get("merged") else categorize(op)
    out[category] += op["ms"]
  out["idle"] = max(summary["span_ms"] - summary["busy_ms"], 0.0)
  return out


def load(path: str, steps: int | None = None) -> dict:
  """A summary from a per-op JSON or a trace directory (`steps`: how many
  steps the trace holds; a saved summary knows)."""
  if os.path.isdir(path):
    xplane, hlo_path = find_files(path)
    meta_path = os.path.join(path, "profile_meta.json")
    meta = {}
    if os.path.exists(meta_path):
      with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    hlo_text = None
    if hlo_path:
      with open(hlo_path, encoding="utf-8") as f:
        hlo_text = f.read()
    summary = summarize_trace(xplane, steps or meta.get("steps", 1), hlo_text,
                              label=meta.get("label", os.path.basename(
                                  os.path.normpath(path))),
                              device=meta.get("device"))
    summary.update({k: v for k, v in meta.items() if k not in summary})
    return summary
  with open(path, encoding="utf-8") as f:
    summary = json.load(f)
  if summary.get("format") != FORMAT:
    raise ValueError(f"{path}: not a per-op summary of format {FORMAT} "
                     f"(got format {summary.get('format')!r})")
  return summary


def markdown(summaries: list[dict], top_other: int = 10) -> str:
  """The category table (ms/step and % per run) and each run's largest
  "other" ops."""
  labels = [s.get("label") or f"run {i}" for i, s in enumerate(summaries)]
  cats = [category_ms(s) for s in summaries]
  totals = [sum(c.values()) for c in cats]
  head = "| category | " + " | ".join(f"{l} ms | {l} %" for l in labels)
  lines = [head + " |", "|---|" + "---:|---:|" * len(summaries)]
  for key, name in CATEGORIES:
    cells = " | ".join(f"{c[key]:.3f} | {c[key] / t:.1%}" if t else "0 | -"
                       for c, t in zip(cats, totals))
    lines.append(f"| {name} | {cells} |")
  lines.append("| **total** | " + " | ".join(
      f"**{t:.3f}** | 100%" for t in totals) + " |")
  for label, s in zip(labels, summaries):
    measured = s.get("step_ms")
    lines.append("")
    lines.append(
        f"{label}: {s['steps']} traced steps on {s.get('platform', '?')}; "
        f"per step: span {s['span_ms']:.3f} ms, busy {s['busy_ms']:.3f} ms"
        + (f", timed step {measured:.3f} ms" if measured else "")
        + f"; {s.get('hlo_ops_known', 0)} ops matched to HLO")
  for label, s in zip(labels, summaries):
    other = [op for op in s["ops"]
             if (op["category"] if op.get("merged") else categorize(op))
             == "other"][:top_other]
    if not other:
      continue
    lines += ["", f"Largest ops in \"other\" ({label}):", "",
              "| op | ms/step | calls/step | scope |", "|---|---:|---:|---|"]
    for op in other:
      lines.append(f"| {op['name']} | {op['ms']:.3f} | {op['count']:g} | "
                   f"{op['scope'][:90] or op['kind']} |")
  return "\n".join(lines)


def write_markdown(summaries: list[dict], stem: str) -> str:
  """The table of `summaries` written to <stem>.profile.md and printed;
  returns the path."""
  table = markdown(summaries)
  path = f"{stem}.profile.md"
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(table + "\n")
  print(f"\nDevice time per step by category ({path}):\n\n{table}")
  return path


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.train_profile_table",
      description="Device time per category of a profiled train step.")
  parser.add_argument("paths", nargs="+",
                      help="per-op JSON files or trace directories")
  parser.add_argument("--steps", type=int, default=None,
                      help="steps a trace directory holds (default: its "
                           "profile_meta.json, else 1)")
  parser.add_argument("--top_other", type=int, default=10)
  args = parser.parse_args(argv)
  try:
    summaries = [load(p, args.steps) for p in args.paths]
  except (OSError, ValueError) as e:
    sys.exit(f"train_profile_table: {e}")
  print(markdown(summaries, args.top_other))


if __name__ == "__main__":
  main()
