"""The warp-specialised skeleton shared by the Hopper (Mosaic GPU) kernels.

kernels/gmm_mosaic.py and kernels/tree_attention_mosaic.py run every program
(CTA) as three warpgroups named "wg":

  warpgroup 2      the producer: walks a list of pipeline steps and
                   TMA-copies each step's tiles into a ring of `stages`
                   shared-memory slots, waiting only for a slot to be
                   released ("free" barriers, arrived on by the consumers);
  warpgroups 0, 1  the consumers: each owns 64 rows of the program's 128-row
                   tile and runs wgmma on the slots as they land.

This module holds what the two kernels share: the split and its register
budgets (`warp_specialised`), the producer's walk over the ring
(`produce`), the final wait loop (`drain`) and the launch (`kernel`). How the
consumers wait, compute and release is each kernel's own.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CONSUMERS = 2  # compute warpgroups per program
ROWS_PER_CONSUMER = 64  # one wgmma M: the rows each consumer owns
TILE_ROWS = CONSUMERS * ROWS_PER_CONSUMER  # rows per program
# Registers per thread: the producer only issues copies and gives back what
# the consumers take; of the 512 per thread slot of the three warpgroups,
# each consumer may hold a multiple of 8, at most 256 (40 + 2 x 232 <= 512).
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = min(256, (512 - PRODUCER_REGISTERS) // CONSUMERS // 8 * 8)


def kernel(body, out_type, *, grid, grid_names, compiler_params, interpret,
           scratch_types=()):
  """`plgpu.kernel` with the three warpgroups; `interpret=True` runs it in
  Pallas' GPU interpreter (CPU; uninitialised memory reads as NaN)."""
  return plgpu.kernel(
      body,
      out_type=out_type,
      scratch_types=scratch_types,
      grid=grid,
      grid_names=grid_names,
      num_threads=CONSUMERS + 1,
      thread_name="wg",
      compiler_params=compiler_params,
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )


def warp_specialised(wg, producer, consumer):
  """Runs `producer()` on warpgroup CONSUMERS and `consumer()` on the
  others, each after moving its register budget."""
  @pl.when(wg == CONSUMERS)
  def _():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    producer()

  @pl.when(wg < CONSUMERS)
  def _():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    consumer()


def produce(n_steps, stages, loads, first_step=None):
  """The producer's walk: steps first_step .. first_step + n_steps - 1 of
  the ring (first_step None: 0). Step s fills slot s % stages: for each
  `(free, issue)` of `loads`, in order, it waits until the consumers have
  released the slot (from the second lap on) and calls `issue(i, slot)`
  (i = s - first_step) to start that slot's copies."""
  def body(i, _):
    step = i if first_step is None else first_step + i
    slot = lax.rem(step, stages)
    for free, issue in loads:
      @pl.when(step >= stages)
      def _():
        plgpu.barrier_wait(free.at[slot])
      issue(i, slot)
  lax.fori_loop(0, n_steps, body, None)


def drain(total_steps, stages, frees):
  """Waits for the consumers' last `stages` releases of every barrier in
  `frees`. Pallas' GPU interpreter requires every thread that waits on a
  barrier to have seen each of its completed phases before the barrier is
  freed; on a GPU it only keeps the producer alive until the consumers are
  done."""
  def body(step, _):
    slot = lax.rem(step, stages)
    for free in frees:
      plgpu.barrier_wait(free.at[slot])
  lax.fori_loop(jnp.maximum(total_steps - stages, 0), total_steps, body, None)
