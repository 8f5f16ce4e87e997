"""Context-extension stages: one document stream, long documents, exact resume.

A tiny model trains on a generated corpus of packages (directories of small
files whose every line names its file) through a 16 -> 64 token schedule.
The batches each step trains on are recorded, and the documents in them are
read back from their text.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax.config import ConfigError
from m2jax.data import (DataConfig, Packages, make_iterator, make_tokenizer,
                        next_stage_start, split_documents)
from m2jax.train import loop
from m2jax.train.config import TrainConfig
from m2jax.train.metrics import read_metrics

MCFG = config_lib.apply_overrides(config_lib.TINY, [
    "num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
    "head_dim=8", "rotary_dim=4", "num_experts=4", "moe_intermediate_size=16"])
# The model, train config and batch shapes ((4, 16) then (1, 64)) of
# tests/test_train.py's context-schedule test: one jitted step serves both.
TCFG = TrainConfig(steps=8, learning_rate=3e-3, warmup_steps=2, log_every=1,
                   eval_every=6, eval_batches=2, checkpoint_every=2,
                   context_schedule=((0.0, 16), (0.5, 64)))
STAGE_TWO = 4  # round(0.5 * 8)
ROW_ONE, ROW_TWO = 16, 64
WORDS = ("ab", "cd", "ef", "xyz")
# Every line of file pkgNN/[sub/]modM.txt is "PNNMM <word>": a short line, so
# every piece of a document longer than 12 tokens holds a whole id.
FILE_ID = re.compile(r"P\d\dM\d")


@pytest.fixture(scope="module")
def packages_dir(tmp_path_factory):
  """30 packages pkgNN/ of 2-5 files modM.txt (pkgNN/sub/ for the last), of
  3-12 lines each (20-110 bytes a file, up to 550 bytes a package)."""
  rng = random.Random(0)
  root = tmp_path_factory.mktemp("corpus")
  for p in range(30):
    n = rng.randint(2, 5)
    for m in range(n):
      sub = "sub/" if m == n - 1 else ""
      path = root / f"pkg{p:02d}" / f"{sub}mod{m}.txt"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text("".join(f"P{p:02d}M{m} {rng.choice(WORDS)}\n"
                              for _ in range(rng.randint(3, 12))))
  return root


def _data(source, **kw) -> DataConfig:
  return DataConfig(**{"source": str(source), "seq_len": ROW_ONE,
                       "batch_size": 4, "validation_fraction": 0.2,
                       "shuffle_window": 8, **kw})


def _record_batches(monkeypatch) -> list[dict[str, np.ndarray]]:
  """The batch of every train step the loop runs from now on, in order."""
  seen = []
  jit_steps = loop.step_lib.jit_steps

  def recording_jit_steps(*args, **kwargs):
    train_fn, eval_fn = jit_steps(*args, **kwargs)

    def train(state, batch):
      seen.append({k: np.array(v) for k, v in batch.items()})
      return train_fn(state, batch)
    return train, eval_fn

  monkeypatch.setattr(loop.step_lib, "jit_steps", recording_jit_steps)
  return seen


def _pretrain(dcfg, workdir, **kw):
  return loop.pretrain(MCFG, TCFG, dcfg, str(workdir), progress=False,
                       sample_tokens=0, **kw)


def _segments(batch, tok):
  """The text of every segment (document piece) of every row."""
  for tokens, seg in zip(batch["tokens"], batch["segment_ids"]):
    for s in np.unique(seg[seg > 0]):
      yield tokens[seg == s], tok.decode(tokens[seg == s])


def _ids(batches, tok, package: bool) -> set[str]:
  """Files ("P03M1"), or packages ("P03"), whose text is in `batches`."""
  found = {m for b in batches for _, text in _segments(b, tok)
           for m in FILE_ID.findall(text)}
  return {m[:3] for m in found} if package else found


@pytest.mark.parametrize("documents", ["files", "packages"])
def test_stage_two_reads_documents_stage_one_did_not(
    packages_dir, tmp_path, monkeypatch, documents):
  dcfg = _data(packages_dir, documents=documents)
  tok = make_tokenizer(dcfg)
  batches = _record_batches(monkeypatch)
  _pretrain(dcfg, tmp_path / "run")
  assert [b["tokens"].shape for b in batches] == (
      [(4, ROW_ONE)] * STAGE_TWO + [(1, ROW_TWO)] * (8 - STAGE_TWO))
  package = documents == "packages"
  first = _ids(batches[:STAGE_TWO], tok, package)
  second = _ids(batches[STAGE_TWO:], tok, package)
  # Far from an epoch (30 packages, ~100 files): a repeat is a re-read.
  assert first and second
  assert not first & second, sorted(first & second)
  # Long documents: stage 2 has pieces longer than a whole stage-1 row.
  assert max(len(t) for b in batches[STAGE_TWO:]
             for t, _ in _segments(b, tok)) > ROW_ONE


def test_kill_and_resume_in_each_stage_is_bitwise_identical(
    packages_dir, tmp_path, monkeypatch):
  dcfg = _data(packages_dir, documents="packages")
  batches = _record_batches(monkeypatch)
  _pretrain(dcfg, tmp_path / "ref")
  reference = list(batches)
  del batches[:]
  cut = tmp_path / "cut"
  # Stopped (with a checkpoint) in stage 1, at the stage switch, and in
  # stage 2; each resume continues from the newest checkpoint.
  _pretrain(dcfg, cut, stop_after=2)
  for stop in (STAGE_TWO, 6, None):
    _pretrain(dcfg, cut, resume=True, stop_after=stop)
  assert len(batches) == len(reference) == 8
  for step, (a, b) in enumerate(zip(reference, batches)):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=f"{step} {key}")
  losses = lambda d: [(l["step"], l.get("loss"), l.get("val_loss"))
                      for l in read_metrics(str(d))]
  assert losses(cut) == losses(tmp_path / "ref")
  with open(cut / "checkpoints" / "8" / "data" / "metadata") as f:
    state = json.load(f)
  assert state["stage"] == 1
  assert 0 < state["iterator"]["start_document"] < state["iterator"][
      "next_document"]


def test_long_stages_switch_to_packages(packages_dir, tmp_path, monkeypatch):
  dcfg = _data(packages_dir, documents="files", context_documents="packages")
  tok = make_tokenizer(dcfg)
  batches = _record_batches(monkeypatch)
  _pretrain(dcfg, tmp_path / "run")
  pieces = lambda bs: [(t, text) for b in bs for t, text in _segments(b, tok)]
  first, second = pieces(batches[:STAGE_TWO]), pieces(batches[STAGE_TWO:])
  # Stage 1 reads single files; stage 2 whole packages: several files in one
  # document, each after a header line, the first file's opening it.
  files = lambda text: set(FILE_ID.findall(text))
  header = re.compile(r"^# pkg\d\d/(sub/)?mod\d.txt$", re.M)
  assert all(len(files(text)) <= 1 and not header.search(text)
             for _, text in first)
  assert all(len({f[:3] for f in files(text)}) <= 1 for _, text in second)
  assert max(len(files(text)) for _, text in second) >= 2
  assert any(header.search(text) for _, text in second)
  assert all(re.match(r"# pkg\d\d/mod0.txt\nP\d\dM0 ", text)
             for t, text in second if t[0] == tok.bos_id)
  # The files view is split by package then, as the packages view is.
  views = [split_documents(c)["validation"] for c in
           (dcfg, dcfg.context_stage(1, ROW_TWO))]
  assert sorted(views[0].files) == sorted(views[1].files)
  assert isinstance(views[1], Packages)


def test_next_stage_starts_at_the_first_document_not_started(packages_dir):
  """Without the row shuffle, rows are consecutive pieces of the stream: stage
  2 begins exactly at the document after the one stage 1 ended in (whose
  remainder is dropped) and reads the stream on from there."""
  short = _data(packages_dir, shuffle_window=0)
  long = short.context_stage(1, ROW_TWO)
  tok = make_tokenizer(short)
  flat = lambda batches: np.concatenate([b["tokens"].ravel() for b in batches])
  stream = flat(_take(make_iterator(short, tok), 40))  # unstaged
  document_starts = np.flatnonzero(stream == tok.bos_id)
  stage_one = make_iterator(short, tok)
  read = flat(_take(stage_one, 2))
  start = next_stage_start(short, stage_one.get_state(), long)
  # Every document holds one BOS; stage 1 began at document 0.
  assert start == np.sum(read == tok.bos_id)
  assert read[-1] != tok.eos_id  # the last document was cut by the switch
  stage_two = make_iterator(long, tok, start_document=start)
  tail = flat(_take(stage_two, 3))
  first = document_starts[start]
  np.testing.assert_array_equal(tail, stream[first:first + len(tail)])
  with pytest.raises(ValueError, match="start_document"):
    make_iterator(long, tok, state=stage_two.get_state(), start_document=1)


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_packages_concatenate_a_directory_in_path_order(tmp_path):
  root = tmp_path / "repo"
  for rel, text in [("lib/b.py", "b = 2\n"), ("lib/a.py", "a = 1"),
                    ("lib/sub/c.py", "c = 3\n"), ("top.py", "t = 0\n")]:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
  docs = split_documents(DataConfig(source=str(root), documents="packages",
                                    validation_fraction=0.0))["train"]
  assert docs.names == ["lib", "top.py"]
  assert list(docs) == [
      "# lib/a.py\na = 1\n# lib/b.py\nb = 2\n# lib/sub/c.py\nc = 3\n",
      "# top.py\nt = 0\n"]
  stdlib = split_documents(DataConfig(documents="packages"))
  names = stdlib["train"].names + stdlib["validation"].names
  assert {"email", "asyncio", "json", "os.py"} <= set(names)
  email = stdlib["train" if "email" in stdlib["train"].names else
                 "validation"]
  text = email[email.names.index("email")]
  assert text.startswith("# email/__init__.py\n") and (
      "\n# email/mime/text.py\n" in text) and len(text) > 256 * 1024


@pytest.mark.parametrize("kwargs, field", [
    ({"documents": "pages"}, "documents"),
    ({"context_documents": "repos"}, "context_documents"),
    ({"documents": "packages", "format": "jsonl"}, "documents"),
    ({"context_documents": "packages", "format": "jsonl"},
     "context_documents"),
])
def test_bad_documents_name_the_field(kwargs, field):
  with pytest.raises(ConfigError, match=f"DataConfig.{field}"):
    DataConfig(**kwargs)


def test_jsonl_packages_and_stageless_context_documents_are_refused(tmp_path):
  (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
  with pytest.raises(ConfigError, match="DataConfig.documents.*d.jsonl"):
    split_documents(DataConfig(source=str(tmp_path), documents="packages"))
  with pytest.raises(ConfigError, match="DataConfig.context_documents"):
    loop._stages(MCFG, TCFG.replace(context_schedule=()),
                 DataConfig(context_documents="packages"))
