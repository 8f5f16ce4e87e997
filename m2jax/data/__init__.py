"""Pretraining data: corpus, tokenizers, packing, grain pipelines.

  config.py     DataConfig
  corpus.py     the embedded stdlib corpus, user text/JSONL, the hash split,
                files or packages (the long-context source) as documents
  tokenizer.py  the Tokenizer protocol and the byte tokenizer (default)
  bpe.py        optional byte-level BPE trained with HF `tokenizers`
  tokenizer_files.py
                the file naming a saved tokenizer's kind (both kinds write it)
  packing.py    the batch format, next_token_targets, bytes per target
  pipeline.py   grain pipelines: make_tokenizer, make_dataset, make_iterator,
                next_stage_start (context stages continue one stream)
  source.py     DataSource: data that brings its own batches to the loop
  chat.py       the chat template: render (ids + assistant mask), parse
  chat_sources.py
                SFT conversations: chat JSONL, the embedded stdlib set, split
  chat_data.py  ChatData: conversations packed whole, with loss_mask
"""

from m2jax.data.chat_data import ChatData
from m2jax.data.config import DataConfig
from m2jax.data.corpus import (Documents, Packages, check_splits,
                               hash_fraction, package_key, split_documents)
from m2jax.data.packing import (next_token_targets, single_document_batch,
                                 target_bytes)
from m2jax.data.pipeline import (
    bytes_per_token,
    make_dataset,
    make_iterator,
    make_tokenizer,
    next_stage_start,
)
from m2jax.data.source import DataSource
from m2jax.data.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    encode_document,
    load_tokenizer,
)

__all__ = [
    "ByteTokenizer",
    "ChatData",
    "DataConfig",
    "DataSource",
    "Documents",
    "Packages",
    "Tokenizer",
    "bytes_per_token",
    "check_splits",
    "encode_document",
    "hash_fraction",
    "load_tokenizer",
    "make_dataset",
    "make_iterator",
    "make_tokenizer",
    "next_stage_start",
    "next_token_targets",
    "package_key",
    "single_document_batch",
    "split_documents",
    "target_bytes",
]
