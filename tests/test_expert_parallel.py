"""The expert-parallel exchange plan against its numpy reference, one device.

tests/sharding_check.py runs the exchange itself on eight fake devices
(tests/test_sharding.py); here `plan`'s integer arithmetic is compared with
m2jax.model.expert_parallel_ref on random count tables, with and without a
capacity or slabs, and one-device exchanges with drops against
`exchange_reference`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from m2jax.model import expert_parallel
from m2jax.model import expert_parallel_ref as ref


def _random_counts(rng, n, e, t, k):
  """[n, e] counts: t tokens per device, k distinct experts each, skewed."""
  counts = np.zeros((n, e), np.int32)
  for s in range(n):
    skew = rng.dirichlet(np.full(e, 0.3))
    for _ in range(t):
      counts[s, rng.choice(e, k, replace=False, p=skew)] += 1
  return counts


def _assert_plan_equals_reference(counts, capacity, slab=None):
  n = counts.shape[0]
  for me in range(n):
    got = expert_parallel.plan(jnp.asarray(counts), me, capacity, slab=slab)
    want = ref.plan_reference(counts, me, capacity, slab)
    assert set(want) == set(expert_parallel.Plan._fields)
    for field in expert_parallel.Plan._fields:
      np.testing.assert_array_equal(
          np.asarray(getattr(got, field)), want[field],
          err_msg=f"{field} of device {me}, capacity {capacity}, slab {slab}")


def test_reference_on_a_worked_example():
  # Two devices, two experts each. Device 0 sends 3 + 1 rows to device 0's
  # experts and 0 + 2 to device 1's; device 1 sends 1 + 0 and 4 + 1.
  counts = np.array([[3, 1, 0, 2], [1, 0, 4, 1]])
  # A 4-row buffer: device 0's buffer fills with source 0's 4 rows (source 1's
  # row is dropped); device 1's takes source 0's 2, then 2 of source 1's 4
  # expert-2 rows (the other 2 and its expert-3 row are dropped).
  np.testing.assert_array_equal(ref.kept_rows(counts, 4),
                                [[[3, 1], [0, 2]], [[0, 0], [2, 0]]])
  p = ref.plan_reference(counts, 1, 4)
  np.testing.assert_array_equal(p["input_offsets"], [0, 1])
  np.testing.assert_array_equal(p["send_sizes"], [0, 2])
  np.testing.assert_array_equal(p["output_offsets"], [4, 2])
  np.testing.assert_array_equal(p["recv_sizes"], [2, 2])
  np.testing.assert_array_equal(p["recv_offsets"], [0, 2])
  np.testing.assert_array_equal(p["return_offsets"], [4, 1])
  assert int(p["dropped"]) == 4
  # 2-row slabs: each (source, destination) pair keeps its first two rows.
  np.testing.assert_array_equal(ref.kept_rows(counts, 0, slab=2),
                                [[[2, 0], [0, 2]], [[1, 0], [2, 0]]])
  p = ref.plan_reference(counts, 0, 0, slab=2)
  np.testing.assert_array_equal(p["output_offsets"], [0, 0])
  np.testing.assert_array_equal(p["recv_offsets"], [0, 2])
  assert int(p["dropped"]) == 2
  _assert_plan_equals_reference(counts, 4)
  _assert_plan_equals_reference(counts, 0, slab=2)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n,e", [(4, 8), (2, 8), (8, 8)])
def test_plan_matches_reference(seed, n, e):
  rng = np.random.default_rng(seed)
  t, k = 12, 3
  counts = _random_counts(rng, n, e, t, k)
  counts[rng.integers(n)] = 0                     # a device with no rows
  worst = expert_parallel.buffer_rows(t, k, e, n, 0.0)
  for capacity in (worst, 20, 7, 0):
    _assert_plan_equals_reference(counts, capacity)
    kept = ref.kept_rows(counts, capacity)
    assert (kept.sum((0, 2)) <= capacity).all()   # no buffer overflows
  # The worst-case buffer drops nothing.
  assert (ref.kept_rows(counts, worst).sum((1, 2)) == counts.sum(1)).all()
  worst_slab = expert_parallel.slab_rows(t, k, e, n, 0.0)
  for slab in (worst_slab, 9, 4, 1):
    _assert_plan_equals_reference(counts, n * slab, slab)
    assert (ref.kept_rows(counts, 0, slab).sum(-1) <= slab).all()
  per_SxD = counts.reshape(n, n, -1).sum(-1)
  assert (ref.kept_rows(counts, 0, worst_slab).sum(-1) == per_SxD).all()


def test_worst_case_buffer_holds_the_worst_routing():
  # Every token of every device picks the same device's experts.
  n, e, t, k = 4, 16, 10, 3
  counts = np.zeros((n, e), int)
  counts[:, :k] = t
  cap = expert_parallel.buffer_rows(t, k, e, n, 0.0)
  assert cap == n * t * k
  assert all(int(expert_parallel.plan(counts, me, cap).dropped) == 0
             for me in range(n))
  assert expert_parallel.buffer_rows(t, k, e, n, 1.0) < cap
  assert expert_parallel.slab_rows(12, 3, 8, 4, 1.0) == 16  # ceil(9 / 8) * 8


@pytest.mark.parametrize("impl", ["dense", "slabs"])
def test_exchange_with_drops_matches_reference(impl):
  # One device (the suite's): the buffer or slab of a 0.25 capacity factor
  # (8 rows) holds fewer than the 32 rows sent, so rows are dropped.
  e, tokens, k, d = 4, 16, 2, 8
  rng = np.random.default_rng(0)
  sizes = rng.multinomial(tokens * k, rng.dirichlet(np.full(e, .4)))[None]
  x = rng.normal(size=(1, tokens * k, d)).astype(np.float32)
  mesh = jax.make_mesh((1,), ("expert",), (jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])

  def body(x_sorted, sizes_e):
    def experts_fn(rows, local_sizes):   # row * (expert id + 1)
      expert = jnp.searchsorted(jnp.cumsum(local_sizes),
                                jnp.arange(rows.shape[0]), side="right")
      return rows * (expert + 1)[:, None].astype(rows.dtype)
    y, dropped = expert_parallel.exchange(
        x_sorted[0], sizes_e[0], experts_fn, top_k=k, capacity_factor=0.25,
        impl=impl)
    return y[None], dropped[None]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"),
                             out_specs=P("expert")))
  y, dropped = (np.asarray(a) for a in fn(x, sizes.astype(np.int32)))
  slab = (expert_parallel.slab_rows(tokens, k, e, 1, 0.25)
          if impl == "slabs" else None)
  want, want_dropped = ref.exchange_reference(
      x, sizes, lambda rows, expert: rows * (expert[:, None] + 1),
      expert_parallel.buffer_rows(tokens, k, e, 1, 0.25), slab)
  assert want_dropped[0] > 0
  np.testing.assert_array_equal(dropped, want_dropped)
  np.testing.assert_allclose(y, want, rtol=1e-6)
