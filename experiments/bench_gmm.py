r"""Grouped-matmul benchmark: ours vs dense, XLA ragged_dot, tokamax, JAX mgpu.

One GPU run times, per problem (tokens T, projection, routing), the dense
matmul of equal flops (the ceiling), `jax.lax.ragged_dot`, tokamax's Mosaic
GPU ragged_dot (a few configs), JAX's `ragged_dot_mgpu` /
`transposed_ragged_dot_mgpu` (a small tile sweep) and kernels.gmm, forward
and forward+backward; checks each result against float32; prints a table and
writes JSON. TFLOP/s count only real rows: 2 * sum(group_sizes) * K * N per
product, x3 for forward+backward (m2jax.params.matmul_flops).

  python -m experiments.bench_gmm --out=benchmarks/results/gmm_h100.json

m2_small's experts (64 of D=1024, F=512), with a tile sweep of ours:
  python -m experiments.bench_gmm --dims=1024,512 --experts=64 \
      --tokens=16384,32768 --impls=dense,ours --routings=uniform \
      --ours_configs=128x4,128x3,256x3,64x4 --out=benchmarks/results/gmm_m2_small_h100.json
"""

import datetime
import json
import os
import traceback

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gmm_cases as gb
from benchmarks import timing
from experiments import cli
from kernels import gmm_mosaic
from m2jax import params

_TOKENS = flags.DEFINE_list("tokens", ["16384", "4096"], "token counts T")
_PROJS = flags.DEFINE_list("projs", ["up", "down"], "up: K=D, N=F; "
                           "down: K=F, N=D (--dims)")
_DIMS = flags.DEFINE_list("dims", ["3072", "1536"], "D,F: the model width "
                          "and one expert's FFN width (M2: 3072,1536)")
_ROUTINGS = flags.DEFINE_list("routings", ["uniform", "zipf"], "routing")
_IMPLS = flags.DEFINE_list(
    "impls", ["dense", "xla", "tokamax", "jax_mgpu", "ours"], "candidates")
_MODES = flags.DEFINE_list("modes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd")
_EXPERTS = flags.DEFINE_integer("experts", 256, "experts (groups)")
_TOP_K = flags.DEFINE_integer("top_k", 8, "experts per token")
_OURS_CONFIGS = flags.DEFINE_list(
    "ours_configs", [], "extra tile configs of ours to time, as "
    "TILE_NxSTAGES (e.g. 128x5); each for forward, dlhs and tgmm")
_SWIGLU = flags.DEFINE_bool("swiglu", False, "time the fused SwiGLU kernel")
_XLA_MAX_T = flags.DEFINE_integer("xla_max_tokens", 4096,
                                  "skip jax.lax.ragged_dot above this T "
                                  "(it densifies and runs out of memory)")
_OUT = flags.DEFINE_string("out", "benchmarks/results/gmm_h100.json", "JSON")
cli.integer_lists("tokens", "dims")
flags.register_validator("dims", lambda v: len(v) == 2,
                         "must be D,F: two integers")
_MAX_ERR = 1e-2


def _shapes():
  """(K, N) of each projection, from --dims."""
  d, f = (int(x) for x in _DIMS.value)
  return {"up": (d, f), "down": (f, d)}

# Peer sweeps: (block_m, block_n, max_concurrent_steps, grid_block_n).
_JAX_FWD_SWEEP = [(128, 128, 4, 1), (128, 128, 4, 4), (64, 256, 4, 1),
                  (128, 192, 4, 1)]
_JAX_TGMM_SWEEP = [(128, 128, 4), (64, 256, 4)]
_TOKAMAX_SWEEP = [
    None,  # its heuristic config
    dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1,
         persistent=True, grid_minor_dim=1, grid_tile_width=1),
    dict(block_m=128, block_n=64, block_k=256, num_stages=2, split_k=1,
         persistent=True, grid_minor_dim=0, grid_tile_width=4),
]


def _problem(t, proj, routing):
  k, n = _shapes()[proj]
  gs = gb.group_sizes(t, _EXPERTS.value, _TOP_K.value, routing)
  m = t * _TOP_K.value
  kx, kw, kc = jax.random.split(jax.random.key(t + len(proj)), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (_EXPERTS.value, k, n), jnp.float32)
       / np.sqrt(k)).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, (m, n), jnp.bfloat16)
  return (x, w, jnp.asarray(gs), cot), gs


class Checker:
  """float32 references on sampled rows and on two groups' weight gradients."""

  def __init__(self, args, gs_np):
    x, w, gs, cot = args
    rng = np.random.default_rng(1)
    self.rows = jnp.asarray(rng.choice(x.shape[0], 64, replace=False))
    self.fwd = gb.sampled_reference(x, w, gs, self.rows)
    self.dx = gb.sampled_reference(cot, w, gs, self.rows, True)
    starts = np.concatenate([[0], np.cumsum(gs_np)[:-1]])
    nonzero = np.flatnonzero(gs_np)
    self.groups = sorted({int(np.argmax(gs_np)),
                          int(nonzero[len(nonzero) // 2])})
    self.dw = [gb.group_reference(x, cot, int(starts[g]), int(gs_np[g]))
               for g in self.groups]

  def __call__(self, mode, out):
    if mode == "fwd":
      return timing.rel_err(out[self.rows], self.fwd)
    if mode == "dlhs":
      return timing.rel_err(out[self.rows], self.dx)
    if mode == "tgmm":
      return max(timing.rel_err(out[g], r)
                 for g, r in zip(self.groups, self.dw))
    return max(self.parts(out).values())

  def parts(self, out):
    o, dx, dw = out
    return dict(fwd=self("fwd", o), dlhs=self("dlhs", dx),
                tgmm=self("tgmm", dw))


def _candidates(impl, mode, proj, sweep_peers, best):
  """[(name, config description, fn)] for one implementation and mode."""
  if impl == "dense":
    return [("dense", "", gb.dense_fwd() if mode == "fwd" else
             gb.dense_fwdbwd())]
  if impl == "xla":  # main() skips (and records) sizes past --xla_max_tokens
    return [("xla", "", gb.xla_fwd() if mode == "fwd" else gb.xla_fwdbwd())]
  if impl == "tokamax":
    # Sweep the forward; forward+backward uses the fastest forward config.
    cfgs = (_TOKAMAX_SWEEP if sweep_peers and mode == "fwd"
            else [best.get("tokamax")])
    mk = gb.tokamax_fwd if mode == "fwd" else gb.tokamax_fwdbwd
    return [("tokamax", json.dumps(c), mk(c)) for c in cfgs]
  if impl == "jax_mgpu":
    # Forward+backward = forward + dlhs (transposed rhs, best forward tiles)
    # + tgmm, each timed on its own and summed in the summary.
    if mode == "fwd":
      cfgs = _JAX_FWD_SWEEP if sweep_peers else [best.get("jax_mgpu_fwd")]
      return [("jax_mgpu", json.dumps(c), gb.jax_mgpu_fwd(*c))
              for c in cfgs if c]
    cfgs = _JAX_TGMM_SWEEP if sweep_peers else [best.get("jax_mgpu_tgmm")]
    out = [("jax_mgpu_tgmm", json.dumps(c), gb.jax_mgpu_tgmm(*c))
           for c in cfgs if c]
    if best.get("jax_mgpu_fwd"):
      c = best["jax_mgpu_fwd"]
      out.append(("jax_mgpu_dlhs", json.dumps(c),
                  gb.jax_mgpu_fwd(*c, transpose=True)))
    return out
  if impl == "ours":
    cfgs = []
    for c in _OURS_CONFIGS.value:
      tile_n, stages = map(int, c.split("x"))
      cfgs.append((c, gmm_mosaic.TileConfig(tile_n=tile_n, stages=stages)))
    if mode == "fwd":
      out = [("ours", "auto", gb.ours_fwd())]
      out += [("ours", d, gb.ours_fwd(c)) for d, c in cfgs]
      if _SWIGLU.value and proj == "up":
        out += [("ours_swiglu_fused", "", gb.ours_swiglu_fwd()),
                ("ours_swiglu_unfused", "", gb.unfused_swiglu_fwd())]
      return out
    out = [("ours", "auto", gb.ours_fwdbwd())]
    if cfgs:
      out += [("ours_dlhs", "auto", gb.ours_dlhs()),
              ("ours_tgmm", "auto", gb.ours_tgmm())]
    out += [("ours_dlhs", d, gb.ours_dlhs(c)) for d, c in cfgs]
    out += [("ours_tgmm", d, gb.ours_tgmm(c)) for d, c in cfgs]
    return out
  raise ValueError(f"unknown impl {impl}")


def _run_one(name, desc, fn, args, check, mode, rows, k, n, record):
  kind = {"jax_mgpu_tgmm": "tgmm", "ours_tgmm": "tgmm", "ours_dlhs": "dlhs",
          "jax_mgpu_dlhs": "dlhs"}.get(name, mode)
  if name.startswith("ours_swiglu"):
    kind = "swiglu"
  try:
    sec, out = timing.time_fn(jax.jit(fn), *args, reps=7, warmup=1,
                              min_time=0.1)
    # The dense ceiling computes a different product: nothing to check.
    err = None if name == "dense" or kind == "swiglu" else check(kind, out)
    parts = (check.parts(out) if kind == "fwdbwd" and name != "dense"
             else None)
    del out
    width = 2 * n if kind == "swiglu" else n  # SwiGLU: two weights at once
    flops = params.matmul_flops(rows, k, width, backward=kind == "fwdbwd")
    tflops = flops / sec / 1e12
    rec = dict(name=name, config=desc, mode=kind, ms=sec * 1e3,
               tflops=tflops, rel_err=err, rel_err_parts=parts,
               ok=err is None or err <= _MAX_ERR)
  except Exception as e:  # pylint: disable=broad-except
    msg = f"{type(e).__name__}: {str(e)[:300]}"
    if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
      msg = "OOM: " + msg
    rec = dict(name=name, config=desc, mode=kind, error=msg)
    if os.environ.get("BENCH_TRACEBACK"):
      traceback.print_exc()
  record.update(rec)
  shown = (f"{rec['ms']:9.3f} ms {rec['tflops']:7.1f} TF/s err "
           f"{rec['rel_err'] if rec['rel_err'] is not None else '-'}"
           if "ms" in rec else rec["error"][:150])
  print(f"  {name:20s} {kind:6s} {desc[:60]:60s} {shown}", flush=True)
  return rec


def main(argv):
  del argv
  device = jax.devices()[0]
  print("device:", device.device_kind, "jax", jax.__version__, flush=True)
  results = dict(device=device.device_kind, jax=jax.__version__,
                 date=datetime.datetime.now().isoformat(),
                 experts=_EXPERTS.value,
                 top_k=_TOP_K.value, max_rel_err=_MAX_ERR, records=[])
  best = {}
  dense_cache = {}
  timing.warm_up_clocks()
  for t in map(int, _TOKENS.value):
    for proj in _PROJS.value:
      for routing in _ROUTINGS.value:
        args, gs_np = _problem(t, proj, routing)
        k, n = _shapes()[proj]
        rows = int(gs_np.sum())  # real rows: the FLOPs count only these
        flops = params.matmul_flops(rows, k, n)
        check = Checker(args, gs_np)
        sweep_peers = not best.get((proj, "swept"))
        print(f"T={t} {proj} K={k} N={n} {routing}: max group "
              f"{gs_np.max()}, empty {int((gs_np == 0).sum())}", flush=True)
        for impl in _IMPLS.value:
          if impl == "xla" and routing != "uniform":
            continue  # XLA densifies: routing does not change its time
          for mode in _MODES.value:
            if impl == "dense" and (t, proj, mode) in dense_cache:
              rec = dict(dense_cache[(t, proj, mode)], routing=routing)
              results["records"].append(rec)
              continue
            if impl == "xla" and t > _XLA_MAX_T.value:
              results["records"].append(dict(
                  tokens=t, proj=proj, routing=routing, impl="xla", name="xla",
                  mode=mode, skipped="jax.lax.ragged_dot densifies to "
                  "[G, M, K] and runs out of memory at this size"))
              continue
            if sweep_peers:
              _pick_best(results["records"], t, proj, routing, best)
            cands = _candidates(impl, mode, proj, sweep_peers, best)
            for name, desc, fn in cands:
              rec = dict(tokens=t, proj=proj, routing=routing, K=k, N=n,
                         flops=flops, impl=impl)
              _run_one(name, desc, fn, args, check, mode, rows, k, n, rec)
              results["records"].append(rec)
              if impl == "dense":
                dense_cache[(t, proj, mode)] = rec
        if sweep_peers:
          _pick_best(results["records"], t, proj, routing, best)
          best[(proj, "swept")] = True
        del args
        _write(results)  # keep what is done if a later problem fails
  _summary(results)
  _write(results)
  print("wrote", _OUT.value)


def _write(results):
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=1)


def _fastest(recs, allow_bad=False):
  ok = [r for r in recs if r.get("ok") or (allow_bad and "ms" in r)]
  return min(ok, key=lambda r: r["ms"]) if ok else None


def _pick_best(records, t, proj, routing, best):
  mine = [r for r in records if (r["tokens"], r["proj"], r["routing"]) ==
          (t, proj, routing)]
  tk = _fastest([r for r in mine if r["name"] == "tokamax" and
                 r["mode"] == "fwd"])
  if tk:
    best["tokamax"] = json.loads(tk["config"])
  jf = _fastest([r for r in mine if r["name"] == "jax_mgpu"])
  jt = _fastest([r for r in mine if r["name"] == "jax_mgpu_tgmm"])
  if jf:
    best["jax_mgpu_fwd"] = tuple(json.loads(jf["config"]))
  if jt:
    best["jax_mgpu_tgmm"] = tuple(json.loads(jt["config"]))


def _summary(results):
  """Per problem: best of each implementation, forward and forward+backward.

  JAX mgpu forward+backward is the sum of its best forward, its lhs gradient
  (transposed rhs, the forward's tiles) and its best tgmm.
  """
  recs = results["records"]
  keys = sorted({(r["tokens"], r["proj"], r["routing"]) for r in recs},
                key=lambda k: (-k[0], k[1], k[2]))
  rows = []
  print("\nTFLOP/s (real rows only); x = ratio to dense of the same run")
  print(f"{'T':>6} {'proj':5} {'routing':8} {'mode':7} {'dense':>7} "
        f"{'xla':>7} {'tokamax':>8} {'jax_mgpu':>9} {'ours':>7} "
        f"{'ours/dense':>10} {'ours/peer':>9}")
  for key in keys:
    mine = [r for r in recs if (r["tokens"], r["proj"], r["routing"]) == key]
    for mode in ("fwd", "fwdbwd"):
      def get(name, mode=mode, allow_bad=False):  # ours: gmm()'s own config
        return _fastest([r for r in mine if r["name"] == name and
                         r["mode"] == mode and
                         (name != "ours" or r["config"] == "auto")],
                        allow_bad)
      dense, xla, ours = (get(x) for x in ("dense", "xla", "ours"))
      tk = get("tokamax")
      tk_bad = tk is None and get("tokamax", allow_bad=True)
      if tk_bad:  # shown in brackets, not counted as a peer result
        print(f"  (tokamax {mode} at {key}: {tk_bad['tflops']:.1f} TF/s but "
              f"rel err {tk_bad['rel_err']:.3g} > {_MAX_ERR})")
      jm = get("jax_mgpu", "fwd")
      jm_tf = None
      if mode == "fwd" and jm:
        jm_tf = jm["tflops"]
      elif mode == "fwdbwd":
        jt, jd = get("jax_mgpu_tgmm", "tgmm"), get("jax_mgpu_dlhs", "dlhs")
        if jm and jt and jd:
          jm_tf = (params.FWD_BWD * jm["flops"]
                   / (jm["ms"] + jd["ms"] + jt["ms"]) / 1e9)
      vals = dict(dense=dense and dense["tflops"], xla=xla and xla["tflops"],
                  tokamax=tk and tk["tflops"], jax_mgpu=jm_tf,
                  ours=ours and ours["tflops"])
      if not any(vals.values()):
        continue
      peer = max([v for k, v in vals.items() if k in ("xla", "tokamax",
                                                      "jax_mgpu") and v] or [0])
      fmt = lambda v: f"{v:7.1f}" if v else "      -"
      r_dense = (vals["ours"] / vals["dense"]
                 if vals["ours"] and vals["dense"] else None)
      r_peer = vals["ours"] / peer if vals["ours"] and peer else None
      print(f"{key[0]:>6} {key[1]:5} {key[2]:8} {mode:7} {fmt(vals['dense'])} "
            f"{fmt(vals['xla'])} {fmt(vals['tokamax']):>8} "
            f"{fmt(vals['jax_mgpu']):>9} {fmt(vals['ours'])} "
            f"{r_dense or 0:10.2f} {r_peer or 0:9.2f}")
      rows.append(dict(tokens=key[0], proj=key[1], routing=key[2], mode=mode,
                       **vals, ours_over_dense=r_dense, ours_over_peer=r_peer))
  results["summary"] = rows


if __name__ == "__main__":
  cli.run(main)
