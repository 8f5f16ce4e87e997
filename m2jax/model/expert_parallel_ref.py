"""Numpy reference of the expert-parallel exchange (expert_parallel.py).

`expert_parallel.plan` derives every all-to-all offset from the gathered
count table with vectorised cumsums, and `expert_parallel.exchange` moves
rows with them. This module says what they must produce, the slow obvious
way: rows arrive at each destination source by source, each source's rows
grouped by expert, and are kept while there is room (in the destination's
buffer, or in the (source, destination) slab). Tests compare the two
(tests/test_expert_parallel.py on random count tables, tests/sharding_check.py
on eight devices). Numpy only, loops over rows: for tiny tables.
`gather_exchange_reference` does the same for the all-gather exchange
(`expert_parallel.gather_exchange`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def kept_rows(counts_SxE, capacity: int, slab: int | None = None
              ) -> np.ndarray:
  """[S, D, L] rows of each (source, destination, local expert) kept.

  counts_SxE[s, e]: rows source s routes to expert e; destination d owns
  experts [d * L, (d + 1) * L), L = E / n. Without `slab`, d has room for
  `capacity` rows and fills it with sources 0..n-1 in order, each source's
  rows expert by expert. With `slab`, each (source, destination) pair has
  room for `slab` rows and `capacity` is unused (the buffer is n * slab).
  """
  counts_SxE = np.asarray(counts_SxE, np.int64)
  n, e = counts_SxE.shape
  if e % n:
    raise ValueError(f"{e} experts do not split over {n} devices")
  l = e // n
  kept_SxDxL = np.zeros((n, n, l), np.int64)
  for d in range(n):
    room = capacity
    for s in range(n):
      if slab is not None:
        room = slab
      for j in range(l):
        kept_SxDxL[s, d, j] = min(room, counts_SxE[s, d * l + j])
        room -= kept_SxDxL[s, d, j]
  return kept_SxDxL


def plan_reference(counts_SxE, me: int, capacity: int,
                   slab: int | None = None) -> dict[str, np.ndarray]:
  """What `expert_parallel.plan` returns on device `me`, field by field.

  A dict with the fields of `expert_parallel.Plan` (see there): offsets
  count rows in the sender's sorted order (input, return) or in the
  receiver's buffer (output, recv), where sources land one after another
  (at s * slab with slabs).
  """
  counts_SxE = np.asarray(counts_SxE, np.int64)
  n, e = counts_SxE.shape
  kept_SxDxL = kept_rows(counts_SxE, capacity, slab)
  full_SxD = counts_SxE.reshape(n, n, e // n).sum(-1)
  sent_SxD = kept_SxDxL.sum(-1)

  def landing(s: int, d: int) -> int:   # where s's rows start in d's buffer
    return s * slab if slab is not None else int(sent_SxD[:s, d].sum())

  return {
      "input_offsets": np.array([full_SxD[me, :d].sum() for d in range(n)]),
      "send_sizes": sent_SxD[me],
      "output_offsets": np.array([landing(me, d) for d in range(n)]),
      "recv_sizes": sent_SxD[:, me],
      "recv_offsets": np.array([landing(s, me) for s in range(n)]),
      "return_offsets": np.array([full_SxD[s, :me].sum() for s in range(n)]),
      "kept_SxL": kept_SxDxL[:, me],
      "dropped": np.array(full_SxD[me].sum() - sent_SxD[me].sum()),
  }


def exchange_reference(x_SxRxD, counts_SxE,
                       expert_fn: Callable[[np.ndarray, np.ndarray],
                                           np.ndarray],
                       capacity: int, slab: int | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
  """What `expert_parallel.exchange` returns on every device.

  Args:
    x_SxRxD: each source's rows sorted by expert (R = counts_SxE[s].sum()).
    counts_SxE: rows per source and expert.
    expert_fn: (rows [N, D], global expert ids [N]) -> [N, D] outputs.
    capacity, slab: as in `kept_rows`.
  Returns:
    (y_SxRxD: expert_fn of each kept row, zeros for dropped rows;
     dropped_S: rows of each source that found no room).
  """
  x_SxRxD = np.asarray(x_SxRxD)
  counts_SxE = np.asarray(counts_SxE, np.int64)
  n, e = counts_SxE.shape
  l = e // n
  if (counts_SxE.sum(1) != x_SxRxD.shape[1]).any():
    raise ValueError(f"counts per source {counts_SxE.sum(1).tolist()} must "
                     f"all equal the {x_SxRxD.shape[1]} rows per source")
  kept_SxDxL = kept_rows(counts_SxE, capacity, slab)
  ys, dropped_S = [], []
  for s in range(n):
    expert_R = np.repeat(np.arange(e), counts_SxE[s])
    # Rank of each row among its expert's rows: the first kept ones stay.
    rank_R = np.arange(len(expert_R)) - np.searchsorted(expert_R, expert_R)
    keep_R = rank_R < kept_SxDxL[s, expert_R // l, expert_R % l]
    ys.append(np.where(keep_R[:, None], expert_fn(x_SxRxD[s], expert_R), 0))
    dropped_S.append(int((~keep_R).sum()))
  return np.stack(ys), np.array(dropped_S)


def gather_exchange_reference(x_SxTxD, experts_SxTxK, weights_SxTxK,
                              num_experts: int,
                              expert_fn: Callable[[np.ndarray, np.ndarray],
                                                  np.ndarray],
                              capacity: int) -> tuple[np.ndarray, np.ndarray]:
  """What `expert_parallel.gather_exchange` returns on every device.

  Device d owns experts [d * L, (d + 1) * L), L = num_experts / n, and sees
  the group's (token, choice) pairs in the order (source, token, choice).
  It takes its pairs expert by expert, each expert's in that order, while
  there is room for `capacity` rows; the others are dropped.

  Args:
    x_SxTxD, experts_SxTxK, weights_SxTxK: each device's tokens, chosen
      global expert ids and combine weights.
    num_experts: E.
    expert_fn: (rows [N, D], global expert ids [N]) -> [N, D] outputs.
    capacity: rows of local experts each device can hold.
  Returns:
    (y_SxTxD: each token's weighted sum of its kept pairs' outputs;
     dropped_D: pairs each device dropped).
  """
  x = np.asarray(x_SxTxD, np.float64)
  experts = np.asarray(experts_SxTxK)
  weights = np.asarray(weights_SxTxK, np.float64)
  n, t, k = experts.shape
  l = num_experts // n
  y = np.zeros_like(x)
  dropped = np.zeros(n, np.int64)
  for d in range(n):
    room = capacity
    for e in range(d * l, (d + 1) * l):
      for s, i, j in zip(*np.nonzero(experts == e)):  # (s, i, j) order
        if room == 0:
          dropped[d] += 1
          continue
        room -= 1
        y[s, i] += weights[s, i, j] * expert_fn(x[s, i][None],
                                                np.array([e]))[0]
  return y, dropped
