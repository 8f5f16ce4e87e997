"""Pages of the KV cache: the allocator, per-sequence block tables, the
prefix cache (host side; the device pools are m2jax/model/paged.py).

A pool of `num_pages` pages of `page_size` token slots serves every attention
layer at once (one block table per sequence indexes all layers' pools). Page
0 is the trash page (padded tokens write there) and is never handed out.

Sharing. Pages are reference counted. A full page whose tokens (and all
tokens before them) are known has a content key, the hash chain of the
token ids up to its end; a page with a key can be shared:

  * fork: the n samples of one prompt share its full pages (refcount n); the
    prompt's last, partly filled page is copied per sample (`fork` returns
    the copies to make), since each sample writes its own tokens after it;
  * the prefix cache: a finished sequence's keyed pages stay cached (refcount
    0, least recently used first out) and a new request whose prompt starts
    with the same tokens takes them instead of recomputing them (the seeds'
    global KV pool for prefix hits).

A page is only keyed once all its slots hold computed keys of known tokens,
so a cached page is always exactly what a prefill of those tokens writes.
New weights (`new_epoch`, when RL syncs the policy) empty the cache, and
tables made before then are never keyed: their pages hold keys and values
of the old weights.

With MTP speculative decoding the MTP modules' pages ride along in the same
page ids, and module k's entry at position p depends on the token at p + k:
a page's key then also covers the `lookahead` (= K) tokens after it, and the
last `margin` (= 2K) computed positions of a sequence are never shared or
cached (the engine recomputes the MTP entries of that window every round,
from drafts that may be rejected).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

from m2jax.errors import UserError
from m2jax.model.paged import TRASH_PAGE


class OutOfPages(UserError, RuntimeError):
  """The pool cannot hold what was asked (a prompt longer than the pool)."""


def _chain(parent: bytes, tokens) -> bytes:
  data = np.asarray(tokens, np.int64).tobytes()
  return hashlib.blake2b(parent + data, digest_size=16).digest()


@dataclasses.dataclass
class PageTable:
  """One sequence's pages in order, and how many of its tokens are cached."""
  pages: list[int] = dataclasses.field(default_factory=list)
  keys: list[bytes | None] = dataclasses.field(default_factory=list)
  epoch: int = 0   # the pool's weights epoch when the table was made


class PagePool:
  """Allocation, reference counts and the prefix cache over page ids."""

  def __init__(self, num_pages: int, page_size: int, *,
               prefix_cache: bool = True, lookahead: int = 0,
               margin: int = 0):
    if num_pages < 2:
      raise ValueError(f"PagePool needs >= 2 pages (page {TRASH_PAGE} is the "
                       f"trash page), got {num_pages}")
    self.num_pages, self.page_size = num_pages, page_size
    self.prefix_cache = prefix_cache
    self.lookahead, self.margin = lookahead, margin
    self._free = collections.deque(p for p in range(num_pages)
                                   if p != TRASH_PAGE)
    self._refs = np.zeros(num_pages, np.int64)
    self._key_of: dict[int, bytes] = {}
    self._page_of: dict[bytes, int] = {}
    # Keyed pages nobody holds, oldest use first: evicted on demand.
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
    self.epoch = 0

  # ------------------------------------------------------------ counting --

  @property
  def free_pages(self) -> int:
    """Pages that can be handed out now (free or idle in the cache)."""
    return len(self._free) + len(self._idle)

  def used_pages(self) -> int:
    """Pages held by at least one sequence."""
    return int((self._refs > 0).sum())

  def pages_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.page_size)

  # ---------------------------------------------------------- allocation --

  def _take(self) -> int:
    if self._free:
      page = self._free.popleft()
    elif self._idle:
      page, _ = self._idle.popitem(last=False)   # least recently used
      del self._page_of[self._key_of.pop(page)]
    else:
      raise OutOfPages(f"the KV cache is full ({self.num_pages - 1} pages of "
                       f"{self.page_size} tokens)")
    self._refs[page] = 1
    return page

  def _hold(self, page: int) -> None:
    if self._refs[page] == 0:
      self._idle.pop(page, None)
    self._refs[page] += 1

  def release(self, table: PageTable) -> None:
    """Drop a sequence's hold on its pages (keyed ones stay cached)."""
    for page in table.pages:
      self._refs[page] -= 1
      if self._refs[page] == 0:
        if self.prefix_cache and page in self._key_of:
          self._idle[page] = None
        else:
          self._forget(page)
          self._free.append(page)
    table.pages.clear()
    table.keys.clear()

  def _forget(self, page: int) -> None:
    key = self._key_of.pop(page, None)
    if key is not None and self._page_of.get(key) == page:
      del self._page_of[key]

  def grow(self, table: PageTable, num_tokens: int) -> None:
    """Give `table` pages for `num_tokens` tokens in all."""
    while len(table.pages) < self.pages_for(num_tokens):
      table.pages.append(self._take())
      table.keys.append(None)

  def new_epoch(self) -> None:
    """The model's weights changed: every cached page is stale. Idle cached
    pages are freed, held ones lose their keys (freed on release), and
    tables made before now are never keyed again (`commit`)."""
    self.epoch += 1
    for page in self._idle:
      self._free.append(page)
    self._idle.clear()
    self._key_of.clear()
    self._page_of.clear()

  # ------------------------------------------------------------- sharing --

  def shareable(self, num_computed: int) -> int:
    """Full pages among the first num_computed tokens that may be shared
    (outside the last `margin` positions)."""
    return max(0, num_computed - self.margin) // self.page_size

  def _keys(self, tokens, pages: int) -> list[bytes]:
    """Content keys of the first `pages` pages of `tokens`: the hash chain
    through each page's end, plus the `lookahead` tokens after it."""
    S, chain, keys = self.page_size, b"", []
    for i in range(pages):
      chain = _chain(chain, tokens[i * S:(i + 1) * S])
      ahead = tokens[(i + 1) * S:(i + 1) * S + self.lookahead]
      keys.append(_chain(chain, ahead) if self.lookahead else chain)
    return keys

  def match_prefix(self, tokens) -> PageTable:
    """A table holding the cached full pages that start `tokens` (maybe
    none). The last token (and the `margin` before it) is never covered,
    so a prompt always has tokens left to compute its logits from."""
    table = PageTable(epoch=self.epoch)
    if not self.prefix_cache:
      return table
    for key in self._keys(tokens, self.shareable(len(tokens) - 1)):
      page = self._page_of.get(key)
      if page is None:
        break
      self._hold(page)
      if page in self._idle:
        self._idle.move_to_end(page)
      table.pages.append(page)
      table.keys.append(key)
    return table

  def commit(self, table: PageTable, tokens, num_computed: int) -> None:
    """Key every shareable page of `table` (all its slots hold computed
    keys of `tokens`, the first num_computed) so others can share it.
    A table of an earlier weights epoch is left unkeyed."""
    if table.epoch != self.epoch:
      return
    for i, key in enumerate(self._keys(tokens,
                                       self.shareable(num_computed))):
      if table.keys[i] is None:
        table.keys[i] = key
        page = table.pages[i]
        if key not in self._page_of:
          self._page_of[key] = page
          self._key_of[page] = key

  def fork(self, table: PageTable, num_tokens: int, copies: int
           ) -> tuple[list[PageTable], list[tuple[int, int]]]:
    """`copies` tables holding `table`'s first num_tokens tokens.

    Shareable full pages are shared (held once more per copy); the pages
    after them that hold computed tokens are duplicated: returns the new
    tables and the (source, destination) page copies the device must make
    before the copies write.
    """
    shared = self.shareable(num_tokens)
    owned = self.pages_for(num_tokens)
    tables, moves = [], []
    try:
      for _ in range(copies):
        t = PageTable(list(table.pages[:shared]), list(table.keys[:shared]),
                      table.epoch)
        tables.append(t)
        for page in t.pages:
          self._hold(page)
        for i in range(shared, owned):
          page = self._take()
          moves.append((table.pages[i], page))
          t.pages.append(page)
          t.keys.append(None)
    except OutOfPages:
      for t in tables:
        self.release(t)
      raise
    return tables, moves
