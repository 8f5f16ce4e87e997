"""Tests for kernels.gmm: ragged_dot semantics, gradients, backends (CPU).

The Hopper kernels ("mosaic") run here in Pallas' Mosaic GPU interpreter
(which fills fresh buffers with NaN, so an unwritten output element fails the
check); the portable ones ("triton") in the portable interpreter, with their
output aliased to a NaN-filled buffer, and both lower for CUDA on this
CPU-only host.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import gmm as gmm_lib
from kernels import gmm_mosaic
from kernels import gmm_triton

BF16 = jnp.bfloat16


def _groups(rng, m, g, kind):
  if kind == "all_in_one":
    sizes = np.zeros(g, np.int64)
    sizes[rng.integers(g)] = m
  elif kind == "with_zeros_and_tail":  # empty groups, rows past the total
    total = max(m - int(rng.integers(1, 40)), 0)
    sizes = rng.multinomial(total, rng.dirichlet(np.ones(g)))
    sizes[rng.choice(g, size=g // 2, replace=False)] = 0
  else:
    sizes = rng.multinomial(m, rng.dirichlet(np.ones(g)))
  return sizes.astype(np.int32)


def _inputs(seed, m, k, n, g, kind):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rhs = rng.standard_normal((g, k, n)).astype(np.float32) / np.sqrt(k)
  # bf16-representable values, so the float64 reference sees the same inputs.
  lhs = np.asarray(jnp.asarray(lhs, BF16).astype(jnp.float32), np.float64)
  rhs = np.asarray(jnp.asarray(rhs, BF16).astype(jnp.float32), np.float64)
  return lhs, rhs, _groups(rng, m, g, kind), rng


def _ref_gmm(lhs, rhs, sizes):
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  ends = np.cumsum(sizes)
  for gi, (s, e) in enumerate(zip(ends - sizes, ends)):
    out[s:e] = lhs[s:e] @ rhs[gi]
  return out


def _ref_tgmm(lhs, grad, sizes):
  ends = np.cumsum(sizes)
  return np.stack([lhs[s:e].T @ grad[s:e] for s, e in zip(ends - sizes, ends)])


def _rel(x, ref):
  x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(x)), "unwritten (NaN) or non-finite output"
  return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def _check_values_and_grads(seed, m, k, n, g, kind, **kw):
  lhs, rhs, sizes, rng = _inputs(seed, m, k, n, g, kind)
  cot = rng.standard_normal((m, n))
  cot = np.asarray(jnp.asarray(cot, BF16).astype(jnp.float32), np.float64)
  args = (jnp.asarray(lhs, BF16), jnp.asarray(rhs, BF16), jnp.asarray(sizes))

  @jax.jit  # one compile, not one per operation
  def forward_and_vjp(a, b, group_sizes, cot):
    out, vjp = jax.vjp(lambda a, b: gmm_lib.gmm(a, b, group_sizes, **kw), a, b)
    return (out, *vjp(cot))

  out, dlhs, drhs = forward_and_vjp(*args, jnp.asarray(cot, BF16))
  rows = np.arange(m)[:, None] < sizes.sum()
  assert _rel(out, _ref_gmm(lhs, rhs, sizes)) < 1e-2
  assert np.all(np.asarray(out, np.float32)[~rows[:, 0]] == 0)
  assert _rel(dlhs, _ref_gmm(cot, rhs.transpose(0, 2, 1), sizes)) < 1e-2
  assert _rel(drhs, _ref_tgmm(lhs, cot, sizes)) < 1e-2
  assert out.dtype == BF16 and dlhs.dtype == BF16 and drhs.dtype == BF16


# The Mosaic GPU interpreter is slow: few, small cases.
@pytest.mark.parametrize("seed,m,kind", [
    (0, 264, "with_zeros_and_tail"),   # unaligned starts, M % 8 == 0
    (1, 203, "all_in_one"),            # M % 8 != 0, one group holds every row
])
def test_mosaic_kernels_in_interpreter(seed, m, kind):
  _check_values_and_grads(seed, m, 128, 128, 5, kind, backend="mosaic",
                          interpret=True)


@pytest.mark.parametrize("seed,m,k,n,g,kind", [
    (2, 300, 128, 192, 6, "with_zeros_and_tail"),
    (3, 97, 256, 64, 3, "all_in_one"),
    (4, 512, 128, 128, 16, "uniform"),
])
def test_triton_kernels_in_interpreter(seed, m, k, n, g, kind):
  _check_values_and_grads(seed, m, k, n, g, kind, backend="triton",
                          interpret=True)


def test_xla_reference_backend():
  _check_values_and_grads(5, 150, 64, 32, 4, "with_zeros_and_tail",
                          backend="xla")


def test_triton_writes_every_element():
  lhs, rhs, sizes, _ = _inputs(6, 130, 128, 64, 4, "with_zeros_and_tail")
  poison = jnp.full((130, 64), jnp.nan, BF16)
  out = gmm_triton.gmm(jnp.asarray(lhs, BF16), jnp.asarray(rhs, BF16),
                       jnp.asarray(sizes), out_init=poison, interpret=True)
  assert _rel(out, _ref_gmm(lhs, rhs, sizes)) < 1e-2
  poison = jnp.full((4, 128, 64), jnp.nan, BF16)
  dw = gmm_triton.tgmm(jnp.asarray(lhs, BF16), jnp.asarray(lhs[:, :64], BF16),
                       jnp.asarray(sizes), out_init=poison, interpret=True)
  assert _rel(dw, _ref_tgmm(lhs, lhs[:, :64], sizes)) < 1e-2


def test_schedule_covers_each_row_once():
  rng = np.random.default_rng(7)
  for m in (1, 7, 128, 129, 300, 640):
    g = int(rng.integers(1, 12))
    sizes = _groups(rng, m, g, rng.choice(["uniform", "with_zeros_and_tail"]))
    group, row, lo, hi, nt = map(np.asarray, jax.jit(
        gmm_mosaic.row_tile_schedule, static_argnums=(1, 2))(
            jnp.asarray(sizes), m, 128))
    owner = np.full(m, -2)
    for t in range(int(nt[0])):
      assert row[t] % 8 == 0
      rows = np.arange(row[t] + lo[t], row[t] + hi[t])
      assert np.all(owner[rows] == -2), "row written twice"
      owner[rows] = group[t]
    ends = np.cumsum(sizes)
    expect = np.full(m, -1)
    for gi, (s, e) in enumerate(zip(ends - sizes, ends)):
      expect[s:e] = gi
    np.testing.assert_array_equal(owner, expect)


def test_snake_deals_every_item_once():
  """tgmm's work items dealt out in a snake (gmm_mosaic._snake_items): over
  all programs every item comes exactly once, for full and partial last
  waves of either parity, and fewer items than programs."""
  for num_sms in range(1, 8):
    for num_items in range(0, 3 * num_sms + 2):
      seen = []
      for sm in range(num_sms):
        count, item = gmm_mosaic._snake_items(num_items, num_sms, sm)
        seen += [int(item(i)) for i in range(int(count))]
      assert sorted(seen) == list(range(num_items)), (num_sms, num_items)
  _, item = gmm_mosaic._snake_items(10, 4, 0)
  assert [int(item(i)) for i in range(3)] == [0, 7, 8]  # SM 0 snakes back


def test_epilogue_slots_divide_the_chunks():
  """A cycling epilogue reuses its slots across work items, so the slot
  count must divide the chunks of an item: the fused SwiGLU forward with
  its three outputs (6 chunks of 128 bytes beside a 147 KB ring, room for
  5 slots) gets 3; float32 outputs 256 wide (8 chunks) get 4."""
  ring = 3 * 64 * (128 + 256) * 2
  assert gmm_mosaic._out_slots(3 * 128, BF16, ring) == 3
  assert gmm_mosaic._out_slots(256, jnp.float32, 3 * 64 * 384 * 2) == 4
  assert gmm_mosaic._out_slots(128, BF16, ring) == 2  # whole tile at once
  for n_out in (128, 256, 384, 512, 768):
    for dtype in (BF16, jnp.float32):
      slots = gmm_mosaic._out_slots(n_out, dtype, ring)
      assert (n_out // gmm_mosaic._epi_cols(dtype)) % slots == 0


def test_swiglu_fused_kernel_and_vjp():
  lhs, w1, sizes, rng = _inputs(8, 136, 128, 128, 3, "with_zeros_and_tail")
  w3 = np.asarray(jnp.asarray(rng.standard_normal(w1.shape) / 8, BF16)
                  .astype(jnp.float32), np.float64)
  x, a, b, gs = (jnp.asarray(v, BF16) for v in (lhs, w1, w3, sizes))
  gs = jnp.asarray(sizes)
  h1, h3 = _ref_gmm(lhs, w1, sizes), _ref_gmm(lhs, w3, sizes)
  ref = h1 / (1 + np.exp(-h1)) * h3
  fused = gmm_lib.gmm_swiglu(x, a, b, gs, backend="mosaic", interpret=True)
  assert _rel(fused, ref) < 1e-2
  # What the forward under differentiation writes: the SwiGLU and both
  # products, three outputs of one kernel, kept for the backward.
  kern = gmm_lib._Kernels("mosaic", True, None)
  outs = jax.jit(gmm_lib._swiglu_products, static_argnums=4)(x, a, b, gs, kern)
  for got, want in zip(outs, (ref, h1, h3)):
    assert _rel(got, want) < 1e-2
  # Gradients through the custom VJP (triton kernels, interpreted) against
  # autodiff of the reference backend.
  f = lambda be, it: (lambda *p: jnp.sum(gmm_lib.gmm_swiglu(
      *p, gs, backend=be, interpret=it).astype(jnp.float32) ** 2))
  got = jax.jit(jax.grad(f("triton", True), argnums=(0, 1, 2)))(x, a, b)
  want = jax.jit(jax.grad(f("xla", False), argnums=(0, 1, 2)))(x, a, b)
  for g1, g2 in zip(got, want):
    assert _rel(g1, np.asarray(g2.astype(jnp.float32), np.float64)) < 2e-2


def test_errors_name_the_problem():
  x, w = jnp.zeros((8, 128), BF16), jnp.zeros((2, 128, 64), BF16)
  gs = jnp.array([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="auto.*xla.*mosaic.*triton"):
    gmm_lib.gmm(x, w, gs, backend="cuda")
  with pytest.raises(ValueError, match="K"):
    gmm_lib.gmm(jnp.zeros((8, 64), BF16), w, gs)
  with pytest.raises(ValueError, match="group sizes"):
    gmm_lib.gmm(x, w, jnp.array([8], jnp.int32))
  with pytest.raises(ValueError, match="K % 128"):
    gmm_lib.gmm(jnp.zeros((8, 64), BF16), jnp.zeros((2, 64, 64), BF16), gs,
                backend="mosaic", interpret=False)


def test_renamed_backend_and_interpret_type_are_explained():
  from m2jax import settings as settings_lib  # pylint: disable=import-outside-toplevel
  x, w = jnp.zeros((8, 128), BF16), jnp.zeros((2, 128, 64), BF16)
  gs = jnp.array([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="'pallas' is now called 'mosaic'"):
    gmm_lib.gmm(x, w, gs, backend="pallas")
  with pytest.raises(settings_lib.SettingsError,
                     match="gmm_backend.*'pallas' is now called 'mosaic'"):
    settings_lib.Settings(gmm_backend="pallas")
  with pytest.raises(ValueError, match="interpret must be True or False.*"
                     "backend='triton', interpret=True"):
    gmm_lib.gmm(x, w, gs, backend="mosaic", interpret="portable")
  if jax.default_backend() != "gpu":
    for backend in ("mosaic", "triton"):
      with pytest.raises(ValueError, match="needs a GPU or interpret=True"):
        gmm_lib.gmm(x, w, gs, backend=backend)


def test_tiles_reach_the_mosaic_kernels():
  with pytest.raises(ValueError, match="tile_n must be 64, 128, 192 or 256"):
    gmm_mosaic.TileConfig(tile_n=96)
  x, w = jnp.zeros((8, 128), BF16), jnp.zeros((2, 128, 192), BF16)
  gs = jnp.array([4, 4], jnp.int32)
  tiles = gmm_mosaic.TileConfig(tile_n=128)  # does not divide N = 192
  for fn in (lambda: gmm_lib.gmm(x, w, gs, backend="mosaic", interpret=True,
                                 tiles=tiles),
             lambda: gmm_lib.tgmm(x, x[:, :64].repeat(3, 1), gs,
                                  backend="mosaic", interpret=True,
                                  tiles=tiles)):
    with pytest.raises(ValueError, match="N=192"):
      fn()


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="the compiled kernels need a GPU (Hopper for "
                    "mosaic)")
def test_compiled_kernels_on_gpu():
  _check_values_and_grads(2, 300, 128, 192, 6, "with_zeros_and_tail",
                          backend="mosaic")
  # The fused SwiGLU's three-output forward (6 epilogue chunks cycling
  # through 3 slots, row tiles past the groups' total) and its backward.
  lhs, w1, sizes, rng = _inputs(5, 1000, 256, 128, 5, "with_zeros_and_tail")
  w3 = rng.standard_normal(w1.shape) / 16
  x, a, b = (jnp.asarray(v, BF16) for v in (lhs, w1, w3))
  gs = jnp.asarray(sizes)
  f = lambda be: (lambda *p: jnp.sum(gmm_lib.gmm_swiglu(
      *p, gs, backend=be).astype(jnp.float32) ** 2))
  got = jax.jit(jax.value_and_grad(f("mosaic"), argnums=(0, 1, 2)))(x, a, b)
  want = jax.jit(jax.value_and_grad(f("xla"), argnums=(0, 1, 2)))(x, a, b)
  assert _rel(got[0], np.float64(want[0])) < 1e-2
  for g1, g2 in zip(got[1], want[1]):
    assert _rel(g1, np.asarray(g2.astype(jnp.float32), np.float64)) < 2e-2


def test_triton_runs_only_interpreted():
  x, w = jnp.zeros((8, 128), BF16), jnp.zeros((2, 128, 64), BF16)
  gs = jnp.array([4, 4], jnp.int32)
  want = "needs a GPU or interpret" if jax.default_backend() != "gpu" else (
      "runs only with interpret=True")
  with pytest.raises(ValueError, match=want):
    gmm_lib.gmm(x, w, gs, backend="triton")


def test_auto_uses_reference_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("auto picks the kernel on GPU")
  lhs, rhs, sizes, _ = _inputs(9, 40, 32, 16, 3, "uniform")
  f32 = jnp.float32
  out = gmm_lib.gmm(jnp.asarray(lhs, f32), jnp.asarray(rhs, f32),
                    jnp.asarray(sizes))  # f32, K % 128 != 0: reference only
  assert _rel(out, _ref_gmm(lhs, rhs, sizes)) < 1e-5


def test_layers_share_one_lowered_kernel_per_shape(monkeypatch):
  # Cross-lower a train step for CUDA (Mosaic GPU lowering needs no GPU): the
  # kernels sit behind one jit each, so 3 layers emit as many Mosaic kernels
  # as 1 layer does instead of 3x as many.
  from m2jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from m2jax import model  # pylint: disable=import-outside-toplevel
  from m2jax.settings import Settings  # pylint: disable=import-outside-toplevel
  from m2jax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from m2jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  from m2jax.train.config import TrainConfig  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(gmm_lib, "_on_gpu", lambda: True)

  def kernels_in_step(layers):
    mcfg = config_lib.TINY.replace(
        num_layers=layers, hidden_size=128, moe_intermediate_size=128,
        compute_dtype="bfloat16", num_mtp_modules=0,
        settings=Settings(gmm_backend="mosaic", attention="xla"))
    tcfg = TrainConfig(steps=10, mtp_depth=0)
    state = jax.eval_shape(
        lambda key: state_lib.init_state(mcfg, tcfg, model.init(mcfg, key)),
        jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((2, 64), jnp.int32)
             for k in ("tokens", "segment_ids", "positions")}
    batch["num_bytes"] = jax.ShapeDtypeStruct((2,), jnp.int32)
    train, _ = step_lib.jit_steps(mcfg, tcfg)
    text = train.trace(state, batch).lower(
        lowering_platforms=("cuda",)).as_text()
    return text.count("custom_call @mosaic_gpu")

  one, three = kernels_in_step(1), kernels_in_step(3)
  assert one > 0 and three == one, (one, three)
