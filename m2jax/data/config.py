"""DataConfig: where the documents come from, how they become batches.

One frozen dataclass for the whole data concern (corpus, split, tokenizer,
packing, batching, shuffling, reader threads, the documents of the context
stages). It validates itself at construction and names the field that is
wrong.
"""

from __future__ import annotations

import dataclasses

from m2jax.config import ConfigError

STDLIB = "stdlib"
FORMATS = ("auto", "text", "jsonl")
TOKENIZERS = ("byte", "bpe")
FILES = "files"
PACKAGES = "packages"
DOCUMENTS = (FILES, PACKAGES)
# Fields that only pack and batch the document stream: configs that differ in
# nothing else read the same stream (see `DataConfig.same_stream`).
_PACKING_FIELDS = ("seq_len", "batch_size", "shuffle_window", "num_threads",
                   "prefetch_batches")


def _fail(field: str, rule: str, value) -> None:
  raise ConfigError(f"DataConfig.{field}: {rule} (got {value!r})")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Data pipeline settings. Defaults train a byte-level model on the stdlib.

  Attributes:
    source: "stdlib" (the running interpreter's standard library *.py files),
      a directory (all files below it), a file, or a glob ("data/*.jsonl").
    format: how user files are read: "text" (one document per file), "jsonl"
      (one document per line, from `text_field`), or "auto" (by extension:
      .jsonl/.ndjson are JSONL, anything else is text). Ignored for stdlib.
    documents: what one document is. "files": one per file (or JSONL line).
      "packages": one per top-level entry of the source, the long-context
      source (repository-level concatenation, as code models use for long
      data): a directory's files (recursively, sorted by path, each preceded
      by the line "# <path relative to the source>") form ONE document, e.g.
      the stdlib's email/ or asyncio/; a top-level file is a package of its
      own. JSONL cannot be read as packages. On CPython 3.12 the stdlib has
      197 packages; with the test suites, test/ alone is 19.6 MB.
    context_documents: what the context-extension stages (every stage of
      `TrainConfig.context_schedule` after the first) read; None: the same as
      `documents`. "packages" with documents="files" is M2's recipe (SPEC
      §2): short first stage on files, long stages on code concatenation.
      A stage that reads the same documents as the stage before it continues
      that stage's document stream; a stage that switches to other documents
      starts their stream at its beginning, so its packages hold files the
      file stage may have read one by one.
    validation_source: optional separate validation data (same forms as
      `source`). When set, `source` is used whole for training; otherwise one
      source is split by a hash of each document's key.
    validation_fraction: the share of documents the hash split sends to
      validation, in [0, 0.5]. When `documents` or `context_documents` is
      "packages", every view is split by package (a file goes where its
      package goes), so no stage trains on text another stage validates on.
    stdlib_tests: include the stdlib's own test suites (test/, tests/,
      idle_test/: 35 MB with them, 13 MB without, on CPython 3.12).
    max_documents: keep only the first n documents (files or packages) of
      each split (by sorted key); for smoke tests and quick runs. None keeps
      all.
    tokenizer: "byte" (256 byte ids + PAD/BOS/EOS) or "bpe" (byte-level BPE
      trained locally with HF `tokenizers`).
    bpe_vocab_size: BPE vocabulary size including the 3 special tokens.
    bpe_train_bytes: at most this many bytes of training text go into BPE
      training (the first documents in shuffled order).
    seq_len: tokens per packed row (T).
    batch_size: rows per batch (B).
    seed: shuffle seed (documents per epoch and the packed-row window).
    shuffle_window: packed rows shuffled together after packing, so that rows
      of one long document spread over several batches; 0 or 1 disables it.
    num_threads: reader threads loading and tokenizing documents (order is
      preserved, so the output does not depend on it; 0 reads inline).
    prefetch_batches: batches prepared ahead in a background thread (0: none).
  """

  source: str = STDLIB
  format: str = "auto"
  text_field: str = "text"
  documents: str = FILES
  context_documents: str | None = None
  validation_source: str | None = None
  validation_fraction: float = 0.02
  stdlib_tests: bool = True
  max_documents: int | None = None
  tokenizer: str = "byte"
  bpe_vocab_size: int = 4096
  bpe_train_bytes: int = 16 * 2**20
  seq_len: int = 256
  batch_size: int = 8
  seed: int = 0
  shuffle_window: int = 1024
  num_threads: int = 2
  prefetch_batches: int = 2

  def __post_init__(self):
    if not isinstance(self.source, str) or not self.source:
      _fail("source", f"must be {STDLIB!r} or a path or glob", self.source)
    if self.format not in FORMATS:
      _fail("format", f"must be one of {FORMATS}", self.format)
    if not isinstance(self.text_field, str) or not self.text_field:
      _fail("text_field", "must be a non-empty string", self.text_field)
    if self.documents not in DOCUMENTS:
      _fail("documents", f"must be one of {DOCUMENTS}", self.documents)
    if self.context_documents not in (None, *DOCUMENTS):
      _fail("context_documents", f"must be None or one of {DOCUMENTS}",
            self.context_documents)
    for name in ("documents", "context_documents"):
      if getattr(self, name) == PACKAGES and self.format == "jsonl":
        _fail(name, "'packages' concatenates whole files, so format='jsonl' "
              "cannot be read as packages", PACKAGES)
    if self.validation_source is not None and (
        not isinstance(self.validation_source, str)
        or not self.validation_source):
      _fail("validation_source", "must be None, 'stdlib' or a path or glob",
            self.validation_source)
    if not (isinstance(self.validation_fraction, (int, float))
            and 0.0 <= self.validation_fraction <= 0.5):
      _fail("validation_fraction", "must be a number in [0, 0.5]",
            self.validation_fraction)
    if self.max_documents is not None and not _is_int(self.max_documents, 1):
      _fail("max_documents", "must be None or an integer >= 1",
            self.max_documents)
    if self.tokenizer not in TOKENIZERS:
      _fail("tokenizer", f"must be one of {TOKENIZERS}", self.tokenizer)
    if not _is_int(self.bpe_vocab_size, 260):
      _fail("bpe_vocab_size", "must be an integer >= 260 (256 bytes + "
            "3 specials + at least one merge)", self.bpe_vocab_size)
    if not _is_int(self.bpe_train_bytes, 1):
      _fail("bpe_train_bytes", "must be an integer >= 1", self.bpe_train_bytes)
    if not _is_int(self.seq_len, 2):
      _fail("seq_len", "must be an integer >= 2", self.seq_len)
    if not _is_int(self.batch_size, 1):
      _fail("batch_size", "must be an integer >= 1", self.batch_size)
    if not _is_int(self.seed, 0) or self.seed >= 2**32:
      _fail("seed", "must be an integer in [0, 2**32)", self.seed)
    if not _is_int(self.shuffle_window, 0):
      _fail("shuffle_window", "must be an integer >= 0", self.shuffle_window)
    if not _is_int(self.num_threads, 0):
      _fail("num_threads", "must be an integer >= 0", self.num_threads)
    if not _is_int(self.prefetch_batches, 0):
      _fail("prefetch_batches", "must be an integer >= 0",
            self.prefetch_batches)


  @property
  def reads_packages(self) -> bool:
    """Whether any stage reads packages (then every view splits by package)."""
    return PACKAGES in (self.documents, self.context_documents)

  def context_stage(self, index: int, seq_len: int) -> DataConfig:
    """The data of context stage `index` (0 is the first), rows of `seq_len`.

    Tokens per batch stay this config's (batch_size x seq_len, at least one
    row a batch); stages after the first read `context_documents` if set.
    """
    tokens = self.batch_size * self.seq_len
    documents = (self.documents if index == 0 or self.context_documents is None
                 else self.context_documents)
    return dataclasses.replace(self, seq_len=seq_len, documents=documents,
                               batch_size=max(1, tokens // seq_len))

  def same_stream(self, other: DataConfig) -> bool:
    """Whether `other` reads the same document stream, packed differently."""
    return _stream_fields(self) == _stream_fields(other)


def _stream_fields(config: DataConfig) -> dict:
  fields = dataclasses.asdict(config)
  for name in _PACKING_FIELDS:
    del fields[name]
  return fields


def _is_int(value, minimum: int) -> bool:
  return (isinstance(value, int) and not isinstance(value, bool)
          and value >= minimum)
