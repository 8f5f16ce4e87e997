"""Tests for m2jax/data: split, tokenizers, packing, targets, resume, inputs."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from m2jax.config import ConfigError
from m2jax.data import (
    ByteTokenizer,
    DataConfig,
    Tokenizer,
    bytes_per_token,
    encode_document,
    hash_fraction,
    load_tokenizer,
    make_dataset,
    make_iterator,
    make_tokenizer,
    next_token_targets,
    split_documents,
)
from m2jax.data import corpus

WORDS = ("alpha", "beta", "gamma", "delta", "def", "return", "(x)", ":", "\n",
         "    ", "import", "class", "=", "+", "1", "#")


def _doc_text(i: int, rng: np.random.Generator) -> str:
  n = int(rng.choice([0, 3, 20, 80, 200]))
  return f"doc{i:03d} " + " ".join(rng.choice(WORDS, size=n)) + "\n"


@pytest.fixture
def text_dir(tmp_path):
  """60 ASCII documents of varied lengths, one per file, in nested dirs."""
  rng = np.random.default_rng(0)
  root = tmp_path / "corpus"
  for i in range(60):
    path = root / f"part{i % 3}" / f"doc{i:03d}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_doc_text(i, rng))
  return root


def _config(source, **kw) -> DataConfig:
  defaults = dict(seq_len=32, batch_size=4, validation_fraction=0.3,
                  shuffle_window=8, num_threads=2, prefetch_batches=2)
  defaults.update(kw)
  return DataConfig(source=str(source), **defaults)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def _segments(batch):
  """Yields (row, segment tokens, segment positions) of every segment."""
  for r in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in np.unique(seg[seg > 0]):
      where = seg == s
      yield r, batch["tokens"][r][where], batch["positions"][r][where]


# ---------------------------------------------------------------- the split


def test_hash_fraction_is_pinned():
  # Fixed values: the split must not change across machines or refactors.
  assert hash_fraction("email/parser.py") == pytest.approx(0.6612687614943619,
                                                           abs=1e-15)
  assert hash_fraction(b'{"text": "a"}') == pytest.approx(0.9881491426328397,
                                                          abs=1e-15)


def test_split_is_deterministic_disjoint_and_complete(text_dir):
  config = _config(text_dir)
  first, second = split_documents(config), split_documents(config)
  train, val = set(first["train"].files), set(first["validation"].files)
  assert train == set(second["train"].files)
  assert val == set(second["validation"].files)
  assert not train & val
  assert len(train | val) == 60
  assert 5 <= len(val) <= 30  # ~30% of 60


def test_split_depends_only_on_relative_path(text_dir, tmp_path):
  moved = tmp_path / "elsewhere" / "copy"
  shutil.copytree(text_dir, moved)
  rel = lambda docs, root: sorted(os.path.relpath(f, root) for f in docs.files)
  a = split_documents(_config(text_dir))["validation"]
  b = split_documents(_config(moved))["validation"]
  assert rel(a, text_dir) == rel(b, moved)


# ----------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_ids():
  tok = ByteTokenizer()
  assert isinstance(tok, Tokenizer)
  assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (
      259, 256, 257, 258)
  text = "def f(x):\n\treturn 'héllo, 世界' # ✓\r\n"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 256
  assert len(ids) == len(text.encode("utf-8"))
  doc = encode_document(tok, text)
  assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
  assert tok.decode(doc) == text  # specials are dropped
  assert tok.byte_lengths()[doc].sum() == len(text.encode("utf-8"))


def test_bpe_tokenizer_trains_round_trips_and_reloads(text_dir, tmp_path):
  pytest.importorskip("tokenizers")
  config = _config(text_dir, tokenizer="bpe", bpe_vocab_size=300)
  tok = make_tokenizer(config, str(tmp_path / "tok"))
  assert isinstance(tok, Tokenizer)
  assert tok.vocab_size == 300
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  text = "def gamma(x):\n    return x + 1  # héllo 世界\n"
  ids = tok.encode(text)
  assert len(ids) < len(text.encode("utf-8"))  # merges were learned
  assert tok.decode(encode_document(tok, text)) == text
  assert tok.byte_lengths()[ids].sum() == len(text.encode("utf-8"))
  # Saved with the run: loading gives the same tokenizer, retraining the same.
  assert load_tokenizer(str(tmp_path / "tok")) == tok
  assert make_tokenizer(config, str(tmp_path / "tok")) == tok
  assert make_tokenizer(config, str(tmp_path / "again")) == tok
  with pytest.raises(ConfigError, match="DataConfig.bpe_vocab_size"):
    make_tokenizer(_config(text_dir, tokenizer="bpe", bpe_vocab_size=400),
                   str(tmp_path / "tok"))


def test_saved_tokenizer_of_another_kind_is_refused(text_dir, tmp_path):
  byte = make_tokenizer(_config(text_dir), str(tmp_path / "tok"))
  assert load_tokenizer(str(tmp_path / "tok")) == byte
  with pytest.raises(ConfigError, match="DataConfig.tokenizer"):
    make_tokenizer(_config(text_dir, tokenizer="bpe"), str(tmp_path / "tok"))


# --------------------------------------------------------- targets and masks


def test_next_token_targets_shift_1_and_2():
  tokens = np.array([[10, 11, 12, 20, 21, 0, 0]])
  segments = np.array([[1, 1, 1, 2, 2, 0, 0]])
  targets, mask = next_token_targets(tokens, segments, shift=1)
  np.testing.assert_array_equal(targets, [[11, 12, 20, 21, 0, 0, 0]])
  np.testing.assert_array_equal(mask, [[1, 1, 0, 1, 0, 0, 0]])
  targets, mask = jax.jit(next_token_targets, static_argnums=2)(
      tokens, segments, 2)
  np.testing.assert_array_equal(targets, [[12, 20, 21, 0, 0, 0, 0]])
  np.testing.assert_array_equal(mask, [[1, 0, 0, 0, 0, 0, 0]])
  _, mask = next_token_targets(tokens, segments, shift=9)  # beyond the row
  assert not np.asarray(mask).any()
  with pytest.raises(ValueError, match="shift"):
    next_token_targets(tokens, segments, shift=0)


# --------------------------------------------------------------- packing


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_packing_preserves_documents_and_respects_boundaries(
    text_dir, tmp_path, tokenizer):
  if tokenizer == "bpe":
    pytest.importorskip("tokenizers")
  config = _config(text_dir, tokenizer=tokenizer, bpe_vocab_size=300)
  tok = make_tokenizer(config)
  docs = split_documents(config)["validation"]
  batches = list(make_dataset(config, tok, "validation"))
  B, T = config.batch_size, config.seq_len
  for batch in batches:
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "tokens": ((B, T), np.int32), "segment_ids": ((B, T), np.int32),
        "positions": ((B, T), np.int32), "num_bytes": ((B,), np.int32),
        "row_ids": ((B,), np.int32)}
    seg = batch["segment_ids"]
    # Segment ids are 1..n in contiguous blocks, padding (0) only at the end.
    for row in seg:
      used = row[row > 0]
      assert np.all(np.diff(row[: len(used)]) >= 0) and np.all(
          np.diff(row[: len(used)]) <= 1)
      assert used.size == 0 or used[0] == 1
      assert np.all(row[len(used):] == 0)
    np.testing.assert_array_equal(batch["tokens"][seg == 0], tok.pad_id)
    for _, _, positions in _segments(batch):
      np.testing.assert_array_equal(positions, np.arange(len(positions)))
    # Valid targets never cross a document: EOS predicts nothing, BOS is never
    # a target, at every MTP depth.
    for k in (1, 2, 3):
      targets, mask = map(np.asarray, next_token_targets(
          batch["tokens"], seg, shift=k))
      assert not mask[batch["tokens"] == tok.eos_id].any()
      assert not (targets[mask] == tok.bos_id).any()
      assert np.all(seg[:, :-k][mask[:, :-k]] == seg[:, k:][mask[:, :-k]])
    # num_bytes counts the bytes of exactly the valid next-token targets.
    for r in range(B):
      expect = sum(len(tok.decode(t[1:]).encode()) for row, t, _ in
                   _segments(batch) if row == r)
      assert batch["num_bytes"][r] == expect
  # The finite pass holds every validation document, whole and in order.
  stream = np.concatenate([b["tokens"][b["segment_ids"] > 0]
                           for b in batches])
  expected = np.concatenate([encode_document(tok, d) for d in docs])
  np.testing.assert_array_equal(stream, expected)
  assert batches[-1]["segment_ids"][-1, -1] == 0  # the tail is padded


def test_bytes_per_token(text_dir):
  config = _config(text_dir, tokenizer="byte")
  value = bytes_per_token(config, make_tokenizer(config))
  assert 0.9 < value < 1.0  # every target is one byte except EOS


# ---------------------------------------------------------- order and resume


def _document_order(batches, tok):
  """Document numbers in stream order, read from each 'docNNN' BOS chunk."""
  stream = np.concatenate([b["tokens"].reshape(-1) for b in batches])
  starts = np.flatnonzero(stream == tok.bos_id)
  return [int(tok.decode(stream[s + 1:s + 7])[3:6]) for s in starts
          if s + 7 <= len(stream)]


def test_train_reshuffles_each_epoch_and_follows_seed(text_dir):
  config = _config(text_dir, shuffle_window=0, batch_size=8)
  tok = make_tokenizer(config)
  n_train = len(split_documents(config)["train"])
  order = _document_order(_take(make_iterator(config, tok), 120), tok)
  assert len(order) > 2 * n_train
  first, second = order[:n_train], order[n_train:2 * n_train]
  assert sorted(first) == sorted(second) and len(set(first)) == n_train
  assert first != second
  assert order == _document_order(_take(make_iterator(config, tok), 120), tok)
  other = _config(text_dir, shuffle_window=0, batch_size=8, seed=1)
  assert _document_order(_take(make_iterator(other, tok), 60), tok)[
      :n_train] != first


@pytest.mark.parametrize("steps", [0, 1, 7, 23])
def test_resume_from_json_state_is_bitwise_identical(text_dir, steps):
  config = _config(text_dir)
  tok = make_tokenizer(config)
  it = make_iterator(config, tok)
  _take(it, steps)
  state = json.loads(json.dumps(it.get_state()))
  uninterrupted = _take(it, 30)
  resumed = make_iterator(config, tok, state=state)
  _assert_batches_equal(_take(resumed, 30), uninterrupted)


def test_validation_resume_and_fresh_passes_are_identical(text_dir):
  config = _config(text_dir)
  tok = make_tokenizer(config)
  ds = make_dataset(config, tok, "validation")
  full = list(ds)
  _assert_batches_equal(list(ds), full)
  it = iter(ds)
  _take(it, 2)
  resumed = make_iterator(config, tok, "validation",
                          state=json.loads(json.dumps(it.get_state())))
  _assert_batches_equal(list(resumed), full[2:])


# ------------------------------------------------------------------- inputs


def test_jsonl_and_mixed_directories(tmp_path):
  texts = [f"record {i}: " + "x" * (i * 7) for i in range(30)]
  data = tmp_path / "data"
  data.mkdir()
  with open(data / "a.jsonl", "w") as f:
    for t in texts[:20]:
      f.write(json.dumps({"text": t, "id": 1}) + "\n\n")  # blank lines skipped
  (data / "b.txt").write_text("a plain text document\n")
  (data / ".hidden.txt").write_text("ignored")
  config = _config(data, validation_fraction=0.0)
  assert list(split_documents(config)["train"]) == texts[:20] + [
      "a plain text document\n"]
  # Glob + separate validation source; format forced to jsonl.
  with open(tmp_path / "val.data", "w") as f:
    for t in texts[20:]:
      f.write(json.dumps({"body": t}) + "\n")
  config = _config(str(data / "*.jsonl"), validation_source=str(
      tmp_path / "val.data"), format="jsonl", text_field="body")
  with pytest.raises(ValueError, match="a.jsonl.*'body'"):
    list(split_documents(config)["train"])
  val = split_documents(config)["validation"]
  assert list(val) == texts[20:]
  tok = make_tokenizer(config)
  stream = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in
                           make_dataset(config, tok, "validation")])
  assert tok.decode(stream) == "".join(texts[20:])


def test_jsonl_split_is_by_content_and_disjoint(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n"
                          for i in range(200)))
  docs = split_documents(_config(path, validation_fraction=0.2))
  train, val = set(docs["train"]), set(docs["validation"])
  assert not train & val and len(train | val) == 200
  assert 20 <= len(val) <= 60


def test_missing_source_is_reported(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothing-here"):
    split_documents(_config(tmp_path / "nothing-here"))


# ------------------------------------------------------------------- config


@pytest.mark.parametrize("field, value", [
    ("source", ""), ("format", "csv"), ("text_field", ""),
    ("validation_fraction", 0.9), ("validation_fraction", -0.1),
    ("max_documents", 0), ("tokenizer", "sentencepiece"),
    ("bpe_vocab_size", 100), ("bpe_train_bytes", 0), ("seq_len", 1),
    ("batch_size", 0), ("seed", -1), ("seed", 2**32), ("shuffle_window", -1),
    ("num_threads", -1), ("prefetch_batches", -2), ("seq_len", True),
    ("validation_source", ""),
])
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ConfigError, match=f"DataConfig.{field}"):
    DataConfig(**{field: value})


def test_config_is_frozen_and_hashable():
  config = DataConfig()
  with pytest.raises(Exception):
    config.seq_len = 3  # type: ignore[misc]
  assert hash(config) == hash(DataConfig())


# ------------------------------------------------------------------- stdlib


def test_stdlib_corpus_smoke():
  config = DataConfig(max_documents=4, seq_len=128, batch_size=2)
  docs = split_documents(config)
  assert len(docs["train"]) == 4 and len(docs["validation"]) >= 1
  files = corpus.stdlib_files(include_tests=False)
  keys = [k for k, _ in files]
  assert keys == sorted(keys) and "os.py" in keys
  assert not any(k.startswith(("test/", "site-packages/")) for k in keys)
  assert not any("/test/" in k or "__pycache__" in k for k in keys)
  all_keys = {k for k, _ in corpus.stdlib_files(include_tests=True)}
  assert set(keys) < all_keys
  assert sum(corpus.hash_fraction(k) < 0.02 for k in all_keys) < len(
      all_keys) * 0.05
  tok = make_tokenizer(config)
  it = make_iterator(config, tok)
  text = "".join(tok.decode(b["tokens"]) for b in _take(it, 3))
  assert "def " in text or "import " in text or '"""' in text
  next(iter(make_dataset(config, tok, "validation")))
