"""Prefix-tree merging (Forge, SPEC §3): shared prefixes are computed once.

Samples that share a prefix (a GRPO group's prompt; successive steps of one
agent trajectory, where step t's state is step t-1's state + action +
observation) are merged into a trie of tokens. The trie is flattened
depth-first into packed rows, where every token appears once and:

  positions[t]    = depth of the token = its position in every sample that
                    contains it (RoPE sees exactly the unmerged positions);
  subtree_end[t]  = row-local end of its subtree: key j is visible to query i
                    iff j <= i < subtree_end[j], i.e. i is j or a descendant;
  parent[t]       = row-local index of the previous token on every path
                    through t (-1 at a root): the token whose logits predict
                    t, and the edge the MTP shift follows;
  segment_ids[t]  = 1, 2, ... per tree in the row, 0 for padding.

`sample_index[s, l]` is the flat index (row * T + column) of token l of
sample s, so any per-token output is gathered back into each sample's own
layout (`gather_samples`). Loss masks and payloads (old logprobs,
advantages) stay in that sample layout: a token shared by several samples
may be trained in one and context in another (an agent's earlier action is
part of later states), so they are never merged. The loss is computed per
sample after the gather; a shared token therefore counts once per sample
that contains it and the objective is exactly the unmerged one.

Row budget: a tree longer than `row_len` is split into groups of samples,
each group's union of root paths fitting a row and keeping its own copy of
the prefix it needs (a sample is never cut: its context must be in its
row). Samples join the group where they add the fewest new tokens, so the
repeated prefix is kept small. Groups and whole trees are then bin-packed
first-fit decreasing, one segment each.

Example:
  trees = pack([prompt + r for r in responses], row_len=8192,
               loss_masks=masks, payloads={"old_logprobs": lp})
  out = m2jax.model.forward(cfg, variables, trees.tokens,
                            segment_ids=trees.segment_ids,
                            positions=trees.positions,
                            subtree_end=trees.subtree_end)
  logprobs_SxL = sample_logprobs(out.logits, trees.tokens, trees.parent,
                                 trees.sample_index)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


class _Trie:
  """Tokens as nodes; a node is (parent, token); children in first-seen order."""

  def __init__(self):
    self.parent: list[int] = []
    self.token: list[int] = []
    self.depth: list[int] = []
    self.children: list[dict[int, int]] = []
    self.roots: dict[int, int] = {}

  def insert(self, seq) -> np.ndarray:
    """Adds a sequence; returns the node id of each of its tokens."""
    ids = np.empty(len(seq), np.int64)
    node, kids = -1, self.roots
    for l, tok in enumerate(seq):
      tok = int(tok)
      child = kids.get(tok)
      if child is None:
        child = len(self.token)
        kids[tok] = child
        self.parent.append(node)
        self.token.append(tok)
        self.depth.append(l)
        self.children.append({})
      node, kids = child, self.children[child]
      ids[l] = node
    return ids

  def preorder(self):
    """(order, pre, end): nodes in DFS order, node -> index, subtree end."""
    n = len(self.token)
    order = np.empty(n, np.int64)
    pre = np.empty(n, np.int64)
    end = np.empty(n, np.int64)
    stack = [(r, False) for r in reversed(list(self.roots.values()))]
    i = 0
    while stack:
      node, done = stack.pop()
      if done:
        end[node] = i
        continue
      order[i], pre[node] = node, i
      i += 1
      stack.append((node, True))
      stack.extend((c, False) for c in reversed(list(
          self.children[node].values())))
    return order, pre, end


@dataclasses.dataclass
class PackedTrees:
  """Merged samples in packed rows (numpy). Shapes: R rows of T tokens, S
  samples of at most L tokens."""
  tokens: np.ndarray          # [R, T] int32
  positions: np.ndarray       # [R, T] int32, depth
  subtree_end: np.ndarray     # [R, T] int32, row-local, exclusive
  segment_ids: np.ndarray     # [R, T] int32, 0 = padding
  parent: np.ndarray          # [R, T] int32, row-local, -1 at roots/padding
  sample_index: np.ndarray    # [S, L] int32 flat r * T + t, -1 past the end
  sample_lengths: np.ndarray  # [S] int32
  loss_mask: np.ndarray       # [S, L] bool, False past the end
  payloads: dict              # name -> [S, L] float32, 0 past the end

  @property
  def num_tokens(self) -> int:
    """Tokens actually computed (excluding padding)."""
    return int((self.segment_ids != 0).sum())

  def attention_entries(self) -> int:
    """Visible (query, key) pairs: sum_j subtree_end[j] - j."""
    idx = np.arange(self.tokens.shape[1])[None]
    return int(((self.subtree_end - idx) * (self.segment_ids != 0)).sum())

  def padded_to(self, num_rows: int, pad_id: int = 0) -> "PackedTrees":
    """These trees in `num_rows` rows: padding rows appended, laid out as
    `pack(num_rows=...)` lays them out (every token sees only itself)."""
    R, T = self.tokens.shape
    if num_rows < R:
      raise ValueError(f"padded_to: {R} rows do not fit num_rows={num_rows}")
    extra = num_rows - R

    def grow(x, fill):
      return np.concatenate([x, np.broadcast_to(
          np.asarray(fill, x.dtype), (extra, T))])

    return dataclasses.replace(
        self, tokens=grow(self.tokens, pad_id),
        positions=grow(self.positions, 0),
        subtree_end=grow(self.subtree_end, np.arange(1, T + 1)),
        segment_ids=grow(self.segment_ids, 0), parent=grow(self.parent, -1))

  def model_inputs(self) -> dict:
    """Keyword arguments of m2jax.model.forward for these rows."""
    return {"segment_ids": jnp.asarray(self.segment_ids),
            "positions": jnp.asarray(self.positions),
            "subtree_end": jnp.asarray(self.subtree_end),
            "parent": jnp.asarray(self.parent)}


def _groups_within_budget(trie: _Trie, pre, samples, ends, row_len):
  """Splits one tree's samples into groups whose union of root paths has at
  most row_len tokens. Samples go in depth-first order, each to the group
  where it adds the fewest new tokens (so a group repeats as little of the
  shared prefix as possible), or to a new group if none has room."""
  groups: list[tuple[list[int], set[int]]] = []

  def new_nodes(node, nodes):  # the path's tokens not yet in `nodes`
    out = []
    while node != -1 and node not in nodes:
      out.append(node)
      node = trie.parent[node]
    return out

  for s in sorted(samples, key=lambda s: pre[ends[s]]):
    best, best_new = None, None
    for members, nodes in groups:
      new = new_nodes(ends[s], nodes)
      if len(nodes) + len(new) <= row_len and (
          best_new is None or len(new) < len(best_new)):
        best, best_new = (members, nodes), new
    if best is None:
      best = ([], set())
      groups.append(best)
      best_new = new_nodes(ends[s], best[1])
    best[0].append(s)
    best[1].update(best_new)
  return [members for members, _ in groups]


def _units(seqs, row_len, merge):
  """Lists of sample ids, each becoming one tree (one segment) in a row."""
  if not merge:
    return [[s] for s in range(len(seqs))]
  trie = _Trie()
  paths = [trie.insert(seq) for seq in seqs]
  ends = [int(p[-1]) for p in paths]
  _, pre, end = trie.preorder()
  by_root: dict[int, list[int]] = {}
  for s, path in enumerate(paths):  # a path's first node is its root
    by_root.setdefault(int(path[0]), []).append(s)
  units = []
  for root, samples in by_root.items():
    if end[root] - pre[root] <= row_len:
      units.append(samples)
    else:
      units.extend(_groups_within_budget(trie, pre, samples, ends, row_len))
  return units


def pack(sequences, *, row_len: int, loss_masks=None, payloads=None,
         merge: bool = True, pad_id: int = 0, num_rows: int | None = None,
         max_len: int | None = None) -> PackedTrees:
  """Merges `sequences` into prefix trees packed into rows of `row_len`.

  Args:
    sequences: S token sequences (lists or 1-D int arrays), each 1..row_len
      tokens (a sample must fit one row: it is never cut).
    loss_masks: optional S bool arrays aligned with the tokens (True where
      the token is a trained target); default all False.
    payloads: optional {name: S float arrays aligned with the tokens}.
    merge: False packs every sample as its own chain (the unmerged layout).
    num_rows, max_len: pad R and L to these (fixed shapes for jit).
  """
  seqs = [np.asarray(s, np.int64).reshape(-1) for s in sequences]
  for i, s in enumerate(seqs):
    if not 0 < len(s) <= row_len:
      raise ValueError(f"sample {i} has {len(s)} tokens; each sample needs "
                       f"1..row_len={row_len}")
  units = []
  for unit in _units(seqs, row_len, merge):
    trie = _Trie()
    ids = [trie.insert(seqs[s]) for s in unit]
    units.append((unit, trie, ids))

  # First-fit decreasing into rows.
  rows_used: list[int] = []
  placed = []
  for unit, trie, ids in sorted(units, key=lambda u: -len(u[1].token)):
    size = len(trie.token)
    row = next((r for r, used in enumerate(rows_used)
                if used + size <= row_len), None)
    if row is None:
      row = len(rows_used)
      rows_used.append(0)
    placed.append((row, rows_used[row], unit, trie, ids))
    rows_used[row] += size
  R = len(rows_used) if num_rows is None else num_rows
  if R < len(rows_used):
    raise ValueError(f"need {len(rows_used)} rows, num_rows={num_rows}")
  L = max(len(s) for s in seqs) if max_len is None else max_len
  S, T = len(seqs), row_len

  idx = np.arange(T, dtype=np.int32)
  tokens = np.full((R, T), pad_id, np.int32)
  positions = np.zeros((R, T), np.int32)
  subtree_end = np.broadcast_to(idx + 1, (R, T)).copy()
  segment_ids = np.zeros((R, T), np.int32)
  parent = np.full((R, T), -1, np.int32)
  sample_index = np.full((S, L), -1, np.int32)
  segments_in_row = [0] * R
  for row, off, unit, trie, ids in placed:
    order, pre, end = trie.preorder()
    n = len(order)
    cols = slice(off, off + n)
    tokens[row, cols] = np.asarray(trie.token)[order]
    positions[row, cols] = np.asarray(trie.depth)[order]
    subtree_end[row, cols] = off + end[order]
    par = np.asarray(trie.parent)[order]
    parent[row, cols] = np.where(par >= 0, off + pre[np.maximum(par, 0)], -1)
    segments_in_row[row] += 1
    segment_ids[row, cols] = segments_in_row[row]
    for s, node_ids in zip(unit, ids):
      sample_index[s, :len(node_ids)] = row * T + off + pre[node_ids]

  lengths = np.array([len(s) for s in seqs], np.int32)
  valid = np.arange(L)[None] < lengths[:, None]

  def sample_layout(arrays, dtype):
    out = np.zeros((S, L), dtype)
    for s, a in enumerate(arrays):
      a = np.asarray(a, dtype).reshape(-1)
      if len(a) != lengths[s]:
        raise ValueError(f"sample {s}: {len(a)} values for {lengths[s]} "
                         "tokens")
      out[s, :len(a)] = a
    return out

  mask = (np.zeros((S, L), bool) if loss_masks is None
          else sample_layout(loss_masks, bool) & valid)
  pay = {k: sample_layout(v, np.float32) for k, v in (payloads or {}).items()}
  return PackedTrees(tokens, positions, subtree_end, segment_ids, parent,
                     sample_index, lengths, mask, pay)


# --------------------------------------------- per-token outputs (jnp) -----

def gather_samples(values_RxT, sample_index_SxL, fill=0):
  """values[r, t, ...] -> [S, L, ...] in each sample's layout."""
  R, T = values_RxT.shape[:2]
  flat = values_RxT.reshape((R * T,) + values_RxT.shape[2:])
  idx = jnp.maximum(sample_index_SxL, 0)
  out = jnp.take(flat, idx, axis=0)
  valid = (sample_index_SxL >= 0).reshape(
      sample_index_SxL.shape + (1,) * (out.ndim - 2))
  return jnp.where(valid, out, fill)


def picked_logits(logits_RxTxV, tokens_RxT, parent_RxT):
  """[R, T]: logits[r, parent[r, t], tokens[r, t]], the logit each token was
  predicted with (at parent 0 for roots; token_logprobs masks those).

  One gather with a (row, position, vocab) coordinate per token, each index
  within its own dimension: no flattened index like parent * V + token,
  which overflows int32 once T * V > 2**31 (V = 200,064: rows of 10,734
  tokens). Reads one element per token, never a second [R, T, V] array.
  """
  R = logits_RxTxV.shape[0]
  rows_Rx1 = jnp.arange(R, dtype=jnp.int32)[:, None]
  par = jnp.maximum(parent_RxT, 0)
  return logits_RxTxV[rows_Rx1, par, tokens_RxT].astype(jnp.float32)


def token_logprobs(logits_RxTxV, tokens_RxT, parent_RxT):
  """log p(token t | its ancestors) = log_softmax(logits[parent[t]])[token t].

  [R, T] float32, 0 at roots. The same rule gives MTP depth k: pass that
  depth's logits (tree layout, see m2jax.model.transformer) and keep tokens
  whose parent has depth >= k. Gradients flow to the picked logits and,
  through the log-sum-exp, to every logit of each parent position.
  """
  lse_RxT = jax.nn.logsumexp(logits_RxTxV.astype(jnp.float32), axis=-1)
  par = jnp.maximum(parent_RxT, 0)
  lp = (picked_logits(logits_RxTxV, tokens_RxT, parent_RxT)
        - jnp.take_along_axis(lse_RxT, par, axis=1))
  return jnp.where(parent_RxT >= 0, lp, 0.0)


def sample_logprobs(logits_RxTxV, tokens_RxT, parent_RxT, sample_index_SxL):
  """[S, L]: log p(x_l | x_<l) of every sample token (0 at l = 0 and past
  the end), from logits computed on the merged rows."""
  return gather_samples(token_logprobs(logits_RxTxV, tokens_RxT, parent_RxT),
                        sample_index_SxL)

