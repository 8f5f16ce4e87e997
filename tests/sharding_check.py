"""Sharded vs single-device checks on 8 fake CPU devices (run by
tests/test_sharding.py in its own process, so the rest of the suite keeps one
device). Prints one JSON object of measured differences and counts.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_check.py [DIR]

With DIR, MTP growth's MTP-only phase runs on a mesh too, its run kept in DIR.
"""

import functools
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=wrong-import-position

from m2jax import config as config_lib  # pylint: disable=wrong-import-position
from m2jax import model, sharding  # pylint: disable=wrong-import-position
from m2jax.model import context_parallel  # pylint: disable=wrong-import-position
from m2jax.model import expert_parallel  # pylint: disable=wrong-import-position
from m2jax.model import expert_parallel_ref  # pylint: disable=wrong-import-position
from m2jax.settings import Settings  # pylint: disable=wrong-import-position
from m2jax.train import checkpoint as ckpt_lib  # pylint: disable=wrong-import-position
from m2jax.train import mtp_growth  # pylint: disable=wrong-import-position
from m2jax.train import state as state_lib  # pylint: disable=wrong-import-position
from m2jax.train import step as step_lib  # pylint: disable=wrong-import-position
from m2jax.data import DataConfig  # pylint: disable=wrong-import-position
from m2jax.train.config import TrainConfig  # pylint: disable=wrong-import-position
from m2jax.train.loop import pretrain  # pylint: disable=wrong-import-position
from m2jax.train.metrics import read_metrics  # pylint: disable=wrong-import-position

# Mesh (+ a label) -> how the step runs: "data=2,expert=2,tensor=2" also
# splits each device's tokens into two exchanges, "slabs" exchanges
# fixed-size per-peer slabs (worst-case size: nothing dropped). The mesh
# data=2,fsdp=2,expert=2 is check_pretrain's: its whole train step (loss,
# gradients through two AdamW updates, the bias from the load, the drop
# counter) is checked against one device there.
MESHES = {"data=8": Settings(), "fsdp=2,expert=4": Settings(),
          "data=2,expert=2,tensor=2": Settings(exchange_chunks=2),
          "fsdp=2,expert=4 slabs": Settings(all_to_all="slabs"),
          "fsdp=2,expert=4 allgather": Settings(all_to_all="allgather",
                                                exchange_chunks=2)}
# TINY (8 experts, top-2, GQA 6:2, one MTP module) with one layer: float32.
MCFG = config_lib.TINY.replace(num_layers=1)
# eps well above float32 noise: Adam's first steps are sign-like and would
# blow up 1e-9 differences in near-zero gradients.
TCFG = TrainConfig(steps=10, learning_rate=1e-2, warmup_steps=0, mtp_depth=1,
                   eps=1e-3)


def _batch(B=8, T=16):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MCFG.vocab_size, (B, T), dtype=np.int32)
  seg = np.ones((B, T), np.int32)
  seg[:, T // 2:] = 2          # two documents per row
  seg[::3, -3:] = 0            # and some padding
  pos = np.asarray(model.layers.positions_from_segments(jnp.asarray(seg)))
  return {"tokens": tokens, "segment_ids": seg, "positions": pos,
          "num_bytes": np.full((B,), T, np.int32)}


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float64) -
                                  np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _loss_and_grads(params, bias, batch, mcfg=MCFG):
  loss_fn = functools.partial(step_lib._loss_fn, mcfg=mcfg, tcfg=TCFG)  # pylint: disable=protected-access
  (loss, (_, out)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, bias, batch, jnp.zeros((), jnp.int32))
  dropped = out.routing.dropped.sum() + out.mtp_routing.dropped.sum()
  # The train step's loss runs lm_head chunk by chunk (Settings.loss_chunk)
  # and gets no logits: compare the head's inputs, main and MTP, instead.
  heads = (out.head_inputs if out.logits is None
           else (out.logits, out.mtp_logits[0]))
  return loss, heads[0], heads[1], out.routing.load_E, dropped, grads


def _fresh_jit(settings: Settings = Settings()):
  # The logical rules (and the mesh) are read at trace time and are not
  # part of jit's cache key: a new function object per mesh. The settings
  # travel in the model config, a static argument.
  return jax.jit(functools.partial(
      _loss_and_grads, mcfg=MCFG.replace(settings=settings)))


def check_meshes(variables, batch, result):
  fn = _fresh_jit()
  ref = fn(variables["params"], variables["expert_bias"], batch)
  for spec, settings in MESHES.items():
    t = time.time()
    mesh = sharding.make_mesh(spec.split()[0])
    placed = sharding.place(variables,
                            sharding.variable_shardings(MCFG, mesh))
    fn = _fresh_jit(settings)
    with sharding.use_mesh(mesh):
      got = fn(placed["params"], placed["expert_bias"],
               sharding.shard_batch(batch, mesh))
    result["meshes"][spec] = {
        "loss": _max_diff(ref[0], got[0]),
        "logits": _max_diff(ref[1:3], got[1:3]),
        "load": _max_diff(ref[3], got[3]),
        "dropped": int(got[4]),
        "grads": _max_diff(ref[5], got[5]),
        "grad_scale": float(max(np.max(np.abs(g))
                                for g in jax.tree.leaves(ref[5]))),
        "expert_weight_spec": str(got[5]["layers_0"]["moe"]["w1"]
                                  .sharding.spec),
        "seconds": round(time.time() - t, 1),
    }


# Context parallelism (m2jax.model.context_parallel): the main layer slides
# a window of 5 with a sink token, the MTP block attends in full, so both
# masks cross shard boundaries; the sequence-wise balance loss (documents
# cross shards too) joins the loss.
CP_MCFG = MCFG.replace(attention_pattern=("sliding",), sliding_window=5,
                       num_sink_tokens=1, aux_loss_coef=0.01)
# "tree": the full-attention MTP block's shards run the tree kernels on
# their query rows (what a GPU runs; here the portable kernels,
# interpreted), the sliding-window main layer's shards the blockwise flash
# kernel (what rows past DENSE_MAX_LEN run off a GPU), not the dense mask.
CP_MESHES = {"sequence=8": Settings(), "data=2,sequence=2,tensor=2": Settings(),
             "sequence=8 tree": Settings(attention="tree", interpret=True,
                                         gmm_backend="xla"),
             # The zig-zag placement: each device attends for chunks s and
             # 15 - s of the row's 16.
             "sequence=8 balanced": Settings(sequence_balance=True)}


def _packed_batch(B=8, T=32):
  """Rows of 2 to 5 documents of random lengths (most of them crossing
  shard boundaries at every split of T), some ending in padding."""
  rng = np.random.default_rng(1)
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), rng.integers(1, 5), False))
    seg[b] = 1 + np.searchsorted(cuts, np.arange(T), side="right")
  seg[::3, -5:] = 0
  pos = np.asarray(model.layers.positions_from_segments(jnp.asarray(seg)))
  return {"tokens": rng.integers(0, MCFG.vocab_size, (B, T), dtype=np.int32),
          "segment_ids": seg, "positions": pos,
          "num_bytes": np.full((B,), T, np.int32)}


def check_context_parallel(variables, result):
  """Loss, logits, load and gradients of rows split over "sequence" against
  one device; the lowered program's all-gathers and reduce-scatters show
  that attention ran context-parallel (the MoE makes none without an
  expert axis)."""
  batch = _packed_batch()
  fn = jax.jit(functools.partial(_loss_and_grads, mcfg=CP_MCFG))
  ref = fn(variables["params"], variables["expert_bias"], batch)
  result["context_parallel"] = {}
  for spec, settings in CP_MESHES.items():
    t = time.time()
    mesh = sharding.make_mesh(spec.split()[0])
    placed = sharding.place(variables,
                            sharding.variable_shardings(CP_MCFG, mesh))
    fn = jax.jit(functools.partial(_loss_and_grads,
                                   mcfg=CP_MCFG.replace(settings=settings)))
    with sharding.use_mesh(mesh):
      args = (placed["params"], placed["expert_bias"],
              sharding.shard_batch(batch, mesh))
      lowered = fn.lower(*args)
      got = lowered.compile()(*args)
    text = lowered.as_text()
    result["context_parallel"][spec] = {
        "loss": _max_diff(ref[0], got[0]),
        "logits": _max_diff(ref[1:3], got[1:3]),
        "load": _max_diff(ref[3], got[3]),
        "grads": _max_diff(ref[5], got[5]),
        "logits_spec": str(got[1].sharding.spec),
        "all_gathers": text.count("stablehlo.all_gather"),
        "reduce_scatters": text.count("stablehlo.reduce_scatter"),
        "seconds": round(time.time() - t, 1),
    }
  # Rows the axis does not divide: one line before any work. 24 splits into
  # 8 parts, not into the 16 chunks of the zig-zag placement.
  balanced = CP_MCFG.replace(settings=Settings(sequence_balance=True))
  for name, mcfg, length in (("indivisible", CP_MCFG, 12),
                             ("indivisible_balanced", balanced, 24)):
    try:
      with sharding.use_mesh(sharding.make_mesh("sequence=8")):
        jax.eval_shape(functools.partial(model.forward, mcfg), variables,
                       jnp.zeros((8, length), jnp.int32))
      result["context_parallel"][name] = None
    except context_parallel.ContextParallelError as e:
      result["context_parallel"][name] = str(e)


def _corpus(directory):
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "\n"]
  os.makedirs(directory)
  for i in range(20):
    with open(os.path.join(directory, f"doc{i}.txt"), "w") as f:
      f.write(" ".join(rng.choice(words, 40)))
  return directory


def check_pretrain(tmp, result):
  """The training loop on a mesh (two AdamW steps, an eval, a checkpoint)
  against the same loop on one device; then its checkpoint restored onto a
  different mesh."""
  dcfg = DataConfig(source=_corpus(os.path.join(tmp, "corpus")), seq_len=16,
                    batch_size=8, validation_fraction=0.2)
  # MTP is covered by check_meshes; without it the four compiles are cheaper.
  tcfg = TCFG.replace(steps=2, log_every=1, eval_every=2, eval_batches=1,
                      checkpoint_every=2, mtp_depth=0)
  mesh = sharding.make_mesh("data=2,fsdp=2,expert=2")
  runs = {}
  for name, m in (("ref", None), ("mesh", mesh)):
    runs[name] = pretrain(MCFG, tcfg, dcfg, os.path.join(tmp, name),
                          progress=False, sample_tokens=0, mesh=m)
  lines = {k: read_metrics(os.path.join(tmp, k)) for k in runs}
  state = runs["mesh"]["state"]
  result["train"] = {
      "losses": [l["loss"] for l in lines["mesh"] if "loss" in l],
      "ref_losses": [l["loss"] for l in lines["ref"] if "loss" in l],
      "val_loss": [runs["ref"]["val_loss"], runs["mesh"]["val_loss"]],
      "params": _max_diff(runs["ref"]["state"].params, state.params),
      "bias": _max_diff(runs["ref"]["state"].expert_bias, state.expert_bias),
      "dropped": [l["moe/dropped"] for l in lines["mesh"] if "loss" in l],
      "param_spec": str(state.params["layers_0"]["attn"]["q_proj"]
                        .sharding.spec),
      "mu_spec": str(state.opt_state[1][0].mu["layers_0"]["attn"]["q_proj"]
                     .sharding.spec),
  }
  # Resume onto another mesh: orbax reshards into the target shardings.
  other = sharding.make_mesh("fsdp=2,expert=4")
  target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      state, state_lib.state_shardings(MCFG, tcfg, other))
  ck = ckpt_lib.Checkpointer(os.path.join(tmp, "mesh", "checkpoints"), keep=1)
  step, restored, _, _ = ck.restore_latest(target)
  ck.close()
  w1 = restored.params["layers_0"]["moe"]["w1"]
  result["checkpoint"] = {"step": step, "diff": _max_diff(state, restored),
                          "w1_spec": str(w1.sharding.spec),
                          "w1_mesh": sharding.format_mesh(w1.sharding.mesh)}


def check_mtp_growth(variables, tmp, workdir, result):
  """MTP growth's MTP-only phase on a mesh: K=1 -> 2 by copying, then one
  step with the main model frozen (m2jax.train.mtp_growth). Its optimizer
  state has masked leaves for the frozen parameters; placing it on a mesh
  once failed (MaskedNode against NamedSharding). The run stays in
  `workdir` for the test to read on one device."""
  base_tc = TCFG.replace(steps=3, mtp_depth=1, log_every=1,
                         eval_every=10**9, checkpoint_every=10**9)
  mtp_only_tc = base_tc.replace(mtp_depth=2, mtp_only=True)
  # Host copies: the phase donates the buffers it is given, and `variables`
  # serve the checks after this one.
  host = jax.tree.map(np.array, variables)
  base = state_lib.init_state(MCFG, base_tc, host)._replace(
      step=jnp.asarray(1, jnp.int32))
  cfg, grown = mtp_growth.grow_mtp(MCFG, host, 2)
  grown = jax.tree.map(np.array, grown)
  dcfg = DataConfig(source=os.path.join(tmp, "corpus"), seq_len=16,
                    batch_size=8, validation_fraction=0.2)
  out = pretrain(cfg, mtp_only_tc, dcfg, workdir,
                 init_state=mtp_growth.carry_state(cfg, mtp_only_tc, grown,
                                                   (base_tc, base)),
                 stop_after=2, progress=False, sample_tokens=0,
                 mesh=sharding.make_mesh("data=2,expert=4"))
  params = out["state"].params
  main = [k for k in params if not k.startswith("mtp_")]
  result["mtp_growth"] = {
      "step": int(out["state"].step), "loss": out["train_total_loss"],
      "main_change": _max_diff([grown["params"][k] for k in main],
                               [params[k] for k in main]),
      "mtp_change": _max_diff(grown["params"]["mtp_1"], params["mtp_1"]),
      "mtp_1_sum": _sum(params["mtp_1"])}


def _sum(tree) -> float:
  return float(sum(np.sum(np.asarray(x, np.float64))
                   for x in jax.tree.leaves(tree)))


def check_capacity(variables, batch, result):
  """A tiny capacity buffer drops rows and the counter sees them."""
  mesh = sharding.make_mesh("fsdp=2,expert=4")
  placed = sharding.place(variables, sharding.variable_shardings(MCFG, mesh))
  result["capacity"] = {}
  for impl in ("dense", "slabs", "allgather"):
    cfg = MCFG.replace(settings=Settings(capacity_factor=0.25,
                                         all_to_all=impl))
    forward = jax.jit(functools.partial(model.forward, cfg))
    with sharding.use_mesh(mesh):
      out = forward(placed, sharding.shard_batch(batch, mesh)["tokens"])
    result["capacity"][impl] = {
        "dropped": int(out.routing.dropped.sum()),
        "logits_finite": bool(np.isfinite(out.logits).all())}


def check_exchange_values(result):
  """exchange() with small buffers against its numpy reference: every kept
  row comes back through its own expert, every dropped row as zeros, and the
  counts agree."""
  n, e, tokens, k, d = 4, 8, 24, 2, 8
  mesh = jax.make_mesh((n,), ("expert",), (jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])
  rng = np.random.default_rng(0)
  # Skewed routing: some (source, destination) pairs far above average.
  sizes = np.stack([rng.multinomial(tokens * k, rng.dirichlet(np.full(e, .4)))
                    for _ in range(n)]).astype(np.int32)
  x = rng.normal(size=(n, tokens * k, d)).astype(np.float32)
  result["exchange_values"] = {}
  for impl, factor in (("slabs", 0.5), ("slabs", 0.0), ("dense", 0.5)):

    def body(x_sorted, sizes_e):
      x_sorted, sizes_e = x_sorted[0], sizes_e[0]
      me = jax.lax.axis_index("expert")

      def experts_fn(rows, local_sizes):  # row * (global expert id + 1)
        local = jnp.searchsorted(jnp.cumsum(local_sizes),
                                 jnp.arange(rows.shape[0]), side="right")
        return rows * (me * (e // n) + local + 1)[:, None].astype(rows.dtype)

      y, dropped = expert_parallel.exchange(
          x_sorted, sizes_e, experts_fn, top_k=k, capacity_factor=factor,
          impl=impl)
      return y[None], dropped[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"),
                               out_specs=P("expert")))
    y, dropped = (np.asarray(a) for a in fn(x, sizes))
    slab = (expert_parallel.slab_rows(tokens, k, e, n, factor)
            if impl == "slabs" else None)
    capacity = expert_parallel.buffer_rows(tokens, k, e, n, factor)
    want, want_dropped = expert_parallel_ref.exchange_reference(
        x, sizes, lambda rows, expert: rows * (expert[:, None] + 1),
        capacity, slab)
    result["exchange_values"][f"{impl}@{factor}"] = {
        "max_err": float(np.abs(y - want).max()),
        "dropped": dropped.tolist(), "want_dropped": want_dropped.tolist()}


def check_gather_exchange_values(result):
  """gather_exchange() against its numpy reference on skewed routing, with
  a buffer too small (drops) and the worst-case one (none): outputs,
  drop counts, and the gradients of tokens and weights against the same
  sums computed without any exchange."""
  n, e, tokens, k, d = 4, 8, 24, 2, 8
  mesh = jax.make_mesh((n,), ("expert",), (jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])
  rng = np.random.default_rng(1)
  skew = rng.dirichlet(np.full(e, .4))
  experts = np.stack([[rng.choice(e, k, replace=False, p=skew)
                       for _ in range(tokens)] for _ in range(n)]
                     ).astype(np.int32)
  x = rng.normal(size=(n, tokens, d)).astype(np.float32)
  w = rng.uniform(size=(n, tokens, k)).astype(np.float32)
  scale = lambda ids: ids.astype(np.float32) + 1   # expert e: rows * (e + 1)
  result["gather_exchange"] = {}
  for factor in (0.5, 0.0):

    def body(x, experts, w):
      me = jax.lax.axis_index("expert")

      def experts_fn(rows, local_sizes):
        local = jnp.searchsorted(jnp.cumsum(local_sizes),
                                 jnp.arange(rows.shape[0]), side="right")
        return rows * (me * (e // n) + local + 1)[:, None].astype(rows.dtype)

      y, dropped = expert_parallel.gather_exchange(
          x[0], experts[0], w[0], experts_fn, num_experts=e,
          capacity_factor=factor)
      return y[None], dropped[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("expert"),
                       out_specs=P("expert"))
    y, dropped = (np.asarray(a) for a in jax.jit(fn)(x, experts, w))
    capacity = expert_parallel.buffer_rows(tokens, k, e, n, factor)
    want, want_dropped = expert_parallel_ref.gather_exchange_reference(
        x, experts, w, e, lambda rows, ids: rows * scale(ids)[:, None],
        capacity)
    # Gradients of sum(y * c) for tokens and weights, against the direct sum.
    c = rng.normal(size=x.shape).astype(np.float32)
    got_g = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, experts, w)[0] * c),
                             argnums=(0, 1)))(x, w)
    want_g = jax.grad(lambda x, w: jnp.sum(jnp.einsum(
        "stkd,stk->std", x[:, :, None, :] * scale(experts)[..., None], w)
                                           * c), argnums=(0, 1))(x, w)
    result["gather_exchange"][str(factor)] = {
        "max_err": float(np.abs(y - want).max()),
        "dropped": dropped.tolist(), "want_dropped": want_dropped.tolist(),
        "grad_err": (None if factor else max(
            float(np.abs(a - b).max()) for a, b in zip(got_g, want_g)))}


def check_dense_all_to_all(result):
  """The CPU emulation reproduces ragged_all_to_all's documented example."""
  mesh = jax.make_mesh((2,), ("expert",), (jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  args = [np.array(a, np.int32) for a in (
      [[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]],
      [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
  fn = jax.shard_map(
      lambda *a: expert_parallel.dense_ragged_all_to_all(
          *(x[0] for x in a), axis_name="expert")[None],
      mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
  result["dense_all_to_all"] = np.asarray(jax.jit(fn)(*args)).tolist()


def check_ragged_lowering(variables, batch, result):
  """The GPU path (ragged_all_to_all) traces and differentiates; CPU cannot
  run it, so it is lowered only."""
  mesh = sharding.make_mesh("data=2,expert=2,tensor=2")
  placed = sharding.place(variables, sharding.variable_shardings(MCFG, mesh))
  with sharding.use_mesh(mesh):
    text = _fresh_jit(Settings(all_to_all="ragged")).lower(
        placed["params"], placed["expert_bias"],
        sharding.shard_batch(batch, mesh)).as_text()
  result["ragged_lowering"] = text.count("ragged_all_to_all")


def main():
  start = time.time()
  assert jax.device_count() == 8, jax.devices()
  result = {"meshes": {}}
  variables = model.init(MCFG, jax.random.key(0))
  batch = _batch()
  t = time.time()
  check_meshes(variables, batch, result)
  result["t_meshes"] = round(time.time() - t, 1)
  check_context_parallel(variables, result)
  result["t_context_parallel"] = round(time.time() - t, 1)
  with tempfile.TemporaryDirectory() as tmp:
    check_pretrain(tmp, result)
    result["t_train"] = round(time.time() - t, 1)
    if len(sys.argv) > 1:  # where the MTP growth runs stay
      check_mtp_growth(variables, tmp, sys.argv[1], result)
      result["t_mtp_growth"] = round(time.time() - t, 1)
  check_capacity(variables, batch, result)
  result["t_cap"] = round(time.time() - t, 1)
  check_dense_all_to_all(result)
  check_exchange_values(result)
  check_gather_exchange_values(result)
  check_ragged_lowering(variables, batch, result)
  result["t_ragged"] = round(time.time() - t, 1)
  result["seconds"] = round(time.time() - start, 1)
  json.dump(result, sys.stdout)
  print()


if __name__ == "__main__":
  main()
