"""MQAR (m2jax.eval.mqar): the generator's layout and distances, the
per-query scorer, recall_check's MQAR path and the sweep's MQAR hooks."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from m2jax import report, sweep
from m2jax.config import ConfigError
from m2jax.data.tokenizer import ByteTokenizer
from m2jax.eval import mqar, scoring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = ByteTokenizer()


def _parse(cfg, ex):
  """(pair keys, pair values, [(query index, pair index)]) read back from
  the text by position alone."""
  pairs = ex.text[cfg.offset:cfg.offset + 2 * cfg.pairs]
  keys, values = list(pairs[0::2]), list(pairs[1::2])
  q0 = cfg.offset + 2 * cfg.pairs + cfg.gap
  asked = [(q0 + 2 * j, keys.index(ex.text[q0 + 2 * j]))
           for j in range(cfg.num_queries)]
  return keys, values, asked


@pytest.mark.parametrize("cfg", [
    mqar.MQARConfig(),
    mqar.MQARConfig(pairs=5, queries=3, gap=17, offset=8, length=60),
    mqar.MQARConfig(pairs=26, gap=1, key_vocab=26, value_vocab=2),
])
def test_layout_keys_targets_and_distances(cfg):
  seen = set()
  for seed in range(200):
    ex = mqar.generate(cfg, seed)
    assert len(ex.text) == cfg.text_length
    assert ex.text.isascii() and len(TOK.encode(ex.text)) == len(ex.text)
    keys, values, asked = _parse(cfg, ex)
    assert len(set(keys)) == cfg.pairs  # keys unique within a sequence
    assert set(keys) <= set(mqar.KEY_ALPHABET[:cfg.key_vocab])
    assert set(values) <= set(mqar.VALUE_ALPHABET[:cfg.value_vocab])
    assert len({i for _, i in asked}) == cfg.num_queries  # no key twice
    filler = (ex.text[:cfg.offset] + ex.text[cfg.offset + 2 * cfg.pairs:
                                             asked[0][0]]
              + ex.text[asked[-1][0] + 2:])
    assert set(filler) <= {mqar.FILLER}
    assert len(ex.value_positions) == cfg.num_queries
    for (at, i), target in zip(asked, ex.value_positions):
      # The target after each query key is that key's value.
      assert target == at + 1 and ex.text[target] == values[i]
      distance = at - (cfg.offset + 2 * i)
      lo, hi = cfg.distance_range()
      assert lo <= distance <= hi
      seen.add(distance)
  assert {lo, hi} <= seen  # the stated range is the range that occurs


def test_gap_beyond_reach_puts_every_pair_out_of_reach():
  window, layers = 16, 2
  reach = layers * (window - 1)
  for gap, beyond in ((reach, True), (reach - 1, False)):
    cfg = mqar.MQARConfig(pairs=6, gap=gap, offset=3)
    ex = mqar.generate(cfg, 0)
    _, _, asked = _parse(cfg, ex)
    last_pair_char = cfg.offset + 2 * cfg.pairs - 1
    nearest = min(at for at, _ in asked) - last_pair_char
    assert (nearest > reach) == beyond
  assert mqar.gap_beyond_reach(window, layers) == reach


def test_seeded_gap_independent_and_disjoint_from_evaluation():
  cfg = mqar.MQARConfig(pairs=6)
  assert mqar.generate(cfg, 3) == mqar.generate(cfg, 3)
  assert mqar.generate(cfg, 3) != mqar.generate(cfg, 4)
  # A seed gives the same pairs and queries at every gap.
  strip = lambda ex: ex.text.replace(mqar.FILLER, "")
  assert strip(mqar.generate(cfg, 3)) == strip(
      mqar.generate(cfg.replace(gap=40, offset=2), 3))
  docs = mqar.training_documents(300, cfg, [0, 9, 30], seed=0)
  assert docs == mqar.training_documents(300, cfg, [0, 9, 30], seed=0)
  gaps = {len(d) - 4 * cfg.pairs for d in docs}
  assert gaps == {0, 9, 30}
  evals = {ex.text for gap in (0, 9, 30)
           for ex in mqar.eval_examples(cfg.replace(gap=gap), 300)}
  assert not set(docs) & evals


@pytest.mark.parametrize("fields, needle", [
    ({"pairs": 27}, r"^MQARConfig\.pairs: must be in \[1, key_vocab=26\]"),
    ({"pairs": 4, "key_vocab": 3}, r"^MQARConfig\.pairs: must be in \[1, "),
    ({"queries": 9}, r"^MQARConfig\.queries: must be in \[0, pairs=8\]"),
    ({"gap": -1}, r"^MQARConfig\.gap: must be >= 0 \(got -1\)$"),
    ({"value_vocab": 1}, r"^MQARConfig\.value_vocab: must be in \[2, 26\]"),
    ({"length": 10}, r"^MQARConfig\.length: must be 0 or >= 32"),
])
def test_bad_config_is_one_line(fields, needle):
  with pytest.raises(ConfigError, match=needle) as e:
    mqar.MQARConfig(**fields)
  assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="non-empty list of gaps"):
    mqar.training_documents(2, mqar.MQARConfig(), [])


def _predictor(predict):
  """A stand-in for scoring._argmax: `predict(prefix ids) -> next id`, run
  causally at every position of every row."""

  def argmax(config, variables, tokens, segment_ids):
    del config, variables
    out = np.zeros(tokens.shape, np.int32)
    for b, t in zip(*np.nonzero(segment_ids)):
      out[b, t] = predict(tokens[b, :t + 1])
    return out

  return argmax


def _recall_within(window):
  """Perfect retrieval of a query key's value among the last `window`
  tokens (like one attention layer of that window), else a constant."""

  def predict(prefix):
    seen = prefix[-window:][:-1]
    for j in range(len(seen) - 2, -1, -1):
      if seen[j] == prefix[-1]:
        return seen[j + 1]
    return ord("A")

  return predict


def test_scorer_oracle_scores_one_and_constant_scores_chance(monkeypatch):
  cfg = mqar.MQARConfig(pairs=8, value_vocab=4, gap=40)
  examples = mqar.eval_examples(cfg, 250)
  monkeypatch.setattr(scoring, "_argmax", _predictor(_recall_within(10**6)))
  assert mqar.accuracy(None, None, TOK, examples, batch_size=64) == 1.0
  monkeypatch.setattr(scoring, "_argmax", _predictor(lambda p: ord("B")))
  hits = mqar.query_hits(None, None, TOK, examples, batch_size=64)
  assert [h.shape for h in hits] == [(8,)] * 250
  acc = float(np.concatenate(hits).mean())
  # 2000 queried values: 3 standard errors of a guesser are 0.029.
  assert abs(acc - cfg.chance) < 0.03, acc


def test_scorer_sees_distance_through_a_window(monkeypatch):
  """Retrieval limited to a window solves gaps inside it, not beyond."""
  monkeypatch.setattr(scoring, "_argmax", _predictor(_recall_within(32)))
  cfg = mqar.MQARConfig(pairs=6, value_vocab=26)
  inside = mqar.eval_examples(cfg.replace(gap=0), 30)
  beyond = mqar.eval_examples(cfg.replace(gap=40), 30)
  assert mqar.accuracy(None, None, TOK, inside, batch_size=32) == 1.0
  assert mqar.accuracy(None, None, TOK, beyond, batch_size=32) < 0.1


def test_train_batch_masks_the_queried_values():
  cfg = mqar.MQARConfig(pairs=3, length=24)
  examples = [mqar.generate(cfg.replace(gap=g), s)
              for s, g in ((0, 0), (1, 5), (2, 12))]
  batch, mask_BxT = mqar.train_batch(examples, TOK)
  assert batch["tokens"].shape == mask_BxT.shape == (3, 25)
  assert (batch["tokens"][:, 0] == TOK.bos_id).all()
  for row, mask, ex in zip(batch["tokens"], mask_BxT, examples):
    assert bytes(row[mask].astype(np.uint8)).decode() == "".join(
        ex.text[p] for p in ex.value_positions)
  with pytest.raises(ConfigError, match="one length"):
    mqar.train_batch([mqar.generate(mqar.MQARConfig(gap=g), 0)
                      for g in (0, 1)], TOK)


def test_recall_check_mqar_smoke(tmp_path):
  out = tmp_path / "curve.json"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.recall_check", "--task=mqar",
       "--pairs=2", "--train_gaps=0,3", "--eval_gaps=0,40", "--steps=2",
       "--eval_every=1", "--batch_size=2", "--eval_sequences=2",
       "--hidden_size=16", "--override=num_heads=2",
       "--override=num_kv_heads=1", "--override=head_dim=8",
       "--override=ffn_type=dense", "--override=dense_intermediate_size=16",
       "--attention=sliding",
       "--window=8", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
  # Two steps learn nothing: the verdict is FAIL, exit status 1.
  assert proc.returncode == 1, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("step 1: next-token loss ")
  assert "gap0 " in lines[0] and "gap40 " in lines[0]
  assert "(chance 0.038)" in lines[0]
  assert lines[-1].startswith("gap40: FAIL: held-out recall accuracy ")
  saved = json.loads(out.read_text())
  assert [p["step"] for p in saved["curve"]] == [1, 2]
  assert saved["model"]["attention_pattern"] == ["sliding"]
  assert saved["model"]["sliding_window"] == 8
  assert saved["flags"]["train_gaps"] == ["0", "3"]


def test_sweep_mixes_and_scores_mqar(tmp_path, monkeypatch):
  with pytest.raises(ConfigError, match="^SweepConfig.mqar_gaps: name"):
    sweep.SweepConfig(grid="attention", mqar_fraction=0.5)
  with pytest.raises(ConfigError, match=r"is 300 tokens, longer than "
                     r"seq_len=256"):
    sweep.SweepConfig(grid="attention", seq_len=256, eval_lengths=(128,),
                      mqar_fraction=0.5, mqar_gaps=(0, 258))
  with pytest.raises(ConfigError, match=r"^SweepConfig.mqar_pairs: "
                     r"MQARConfig.pairs"):
    sweep.SweepConfig(grid="attention", mqar_pairs=40)
  with pytest.raises(ConfigError, match="only data='synthetic'"):
    sweep.SweepConfig(grid="attention", data="stdlib", mqar_fraction=0.5,
                      mqar_gaps=(0,))
  cfg = sweep.SweepConfig(grid="attention", seq_len=256, eval_lengths=(128,),
                          train_documents=200, mqar_fraction=0.25,
                          mqar_pairs=4, mqar_gaps=(0, 100), mqar_examples=5)
  train, val = sweep._synthetic_data(str(tmp_path), cfg)
  docs = [json.loads(l)["text"] for l in open(train)]
  fmt = sweep.mqar_config(cfg)
  is_mqar = lambda d: d.startswith(mqar.FILLER * fmt.offset) and all(
      c.isalpha() or c == mqar.FILLER for c in d)
  mqar_docs = [d for d in docs if is_mqar(d)]
  assert len(docs) == 200 and len(mqar_docs) == 50
  gaps = [len(d) - fmt.offset - 4 * fmt.pairs for d in mqar_docs]
  assert 0 <= min(gaps) and max(gaps) <= 100 and len(set(gaps)) > 20
  assert not any(is_mqar(json.loads(l)["text"]) for l in open(val))

  monkeypatch.setattr(scoring, "_argmax", _predictor(_recall_within(64)))
  scores = sweep.score_mqar(None, None, TOK, cfg)
  assert scores == {"0": 1.0, "100": pytest.approx(0.0, abs=0.1)}
  results = {"sweep": {"grid": "attention", "window": 64, "mqar_pairs": 4,
                       "eval_lengths": [128]},
             "base": {"num_layers": 2}, "variants": ["full"],
             "runs": [{"variant": "full", "seed": s, "tokens": 1,
                       "val_loss": 1.0, "val_bpb": 1.0,
                       "tasks": {"cwe": {"128": 0.0}},
                       "routing": {"load_cv": None,
                                   "load_max_over_mean": None},
                       "mqar": {"0": 1.0, "100": a}, "mqar_chance": 1 / 26}
                      for s, a in ((0, 0.5), (1, 0.7))]}
  text = report.markdown(results)
  assert "| variant | seeds | gap 0 | gap 100 |" in text
  assert "| full | 2 | 1.0000 ± 0.0000 | 0.6000 ± 0.1414 |" in text
  assert "reaches 126 tokens back" in text
