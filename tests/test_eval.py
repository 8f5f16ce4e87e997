"""Synthetic long-context tasks, exact-match scoring, and reading a run's
checkpoints (experiments.evaluate)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import run_dirs
from m2jax import config as config_lib
from m2jax import model
from m2jax.errors import MissingPathError
from m2jax.eval import recall, runs, scoring, tasks
from m2jax.infer import sample

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One layer: scoring against greedy decoding does not depend on the depth.
CFG = config_lib.TINY.replace(num_layers=1, num_mtp_modules=0)


@pytest.mark.parametrize("task", tasks.TASKS)
def test_tasks_are_deterministic_and_sized(task):
  for length in (tasks.MIN_LENGTH, 300, 1000):
    a, b = tasks.generate(task, length, 3), tasks.generate(task, length, 3)
    assert a == b
    assert 0.7 * length <= len(a.prompt) <= 1.25 * length + 20, (task, length)
    assert a.answer.strip()
  assert tasks.generate(task, 300, 3) != tasks.generate(task, 300, 4)


def test_answers_are_recoverable_from_the_prompt():
  """Every answer is determined by the context (no task asks the impossible)."""
  ex = tasks.generate("niah_multikey", 400, 0)
  value = ex.answer.strip(" .")
  key = ex.prompt.split("magic number for ")[-1].split("?")[0]
  assert f"The magic number for {key} is {value}." in ex.prompt
  ex = tasks.generate("icl_kv", 400, 0)
  key = ex.prompt.rsplit("\n", 1)[-1].split(" ->")[0]
  assert f"{key} -> {ex.answer.strip()}" in ex.prompt
  for length in (128, 500, 2000):
    ex = tasks.generate("cwe", length, 0)
    words = ex.prompt.split("Words: ")[1].split(".")[0].split()
    counts = sorted(((words.count(w), w) for w in set(words)), reverse=True)
    assert counts[2][0] > counts[3][0]  # the top 3 are unambiguous
    assert ex.answer.strip(" .").split() == [w for _, w in counts[:3]]
  ex = tasks.generate("variable_tracking", 400, 0)
  names = ex.answer.strip(" .").split()
  assert all(f"VAR {n} =" in ex.prompt for n in names)


def test_eval_and_training_seeds_are_disjoint():
  docs = set(tasks.training_documents(30, [128], seed=0))
  evals = {e.prompt + e.answer for t in tasks.TASKS
           for e in tasks.eval_examples(t, 128, 5)}
  assert not docs & evals


def test_drills_ask_for_every_fact_they_state():
  import random
  import re
  doc = tasks.recall_drill(random.Random(3), 600)
  facts = dict(re.findall(r"The magic number for (\w+) is (\d+)\.", doc))
  asked = re.findall(r"What is the magic number for (\w+)\? Answer: (\d+)\.",
                     doc)
  assert len(facts) == 600 // 120 and dict(asked) == facts
  assert doc.index("What is") > max(doc.index(v) for v in facts.values())
  lines = tasks.kv_drill(random.Random(4), 300).splitlines()
  half = len(lines) // 2
  assert sorted(lines[:half]) == sorted(lines[half:]) and half >= 10
  docs = tasks.training_documents(200, [256], seed=0, drill_fraction=0.5)
  n_drills = sum("Answer: " in d and d.count("What is") > 1
                 or d.count(" -> ") > 2 * len(d) // 40 for d in docs)
  assert 60 < n_drills < 140
  assert tasks.training_documents(50, [256], drill_fraction=0.0) == \
      tasks.training_documents(50, [256])
  with pytest.raises(ValueError, match="drill_fraction"):
    tasks.training_documents(5, [256], drill_fraction=1.0)


def test_default_training_documents_are_pinned():
  # Changing them silently would make new sweeps' validation loss
  # incomparable with earlier ones (drills must not shift the default stream).
  import hashlib
  docs = tasks.training_documents(12, [128, 256], seed=3)
  digest = hashlib.sha256("\x00".join(docs).encode()).hexdigest()[:16]
  assert digest == "abca753d7cbabe70"


def test_exact_match_agrees_with_greedy_decoding():
  v = model.init(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  encoded = []
  for n in (5, 9, 17):
    prompt = list(rng.integers(3, 250, n))
    out = np.asarray(sample.greedy(CFG, v, prompt, 4))
    encoded.append((prompt, list(out[n:])))            # what greedy emits
    wrong = list(out[n:])
    wrong[2] = (wrong[2] + 1) % 250
    encoded.append((prompt, wrong))                    # one token off
  got = scoring.exact_match_tokens(CFG, v, encoded, pad_id=0, batch_size=4)
  np.testing.assert_array_equal(got, [True, False] * 3)


def test_recall_batches_query_listed_values():
  batch, mask = recall.recall_batch(np.random.default_rng(0), 3, 5)
  for row, m in zip(batch["tokens"], mask):
    text = bytes(row[1:].tolist()).decode()
    listed = dict(p.split(":") for p in text.split()[:5])
    queried = text.split()[5:]
    assert sorted(queried) == sorted(f"{k}:{v}" for k, v in listed.items())
    # The mask marks exactly the queried value digits.
    assert bytes(row[m].tolist()).decode() == "".join(
        q.split(":")[1] for q in queried)


def test_scoring_pads_to_powers_of_two():
  assert [scoring.padded_length(n) for n in (1, 128, 129, 300, 1024, 1025)] \
      == [128, 128, 256, 512, 1024, 2048]


# ---------------------------------------------------------------------------
# A run's checkpoints, and experiments.evaluate's flags


def _assert_same_tree(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_load_run_picks_the_step(tmp_path):
  saved = run_dirs.write_run(str(tmp_path / "run"), steps=(1, 2))
  # A step the run is saving right now (orbax's temporary name): reading
  # the run (evaluate, export) must leave it alone.
  saving = tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-17000"
  saving.mkdir()
  *_, variables, step = runs.load_run(str(tmp_path / "run"))
  assert step == 2
  _assert_same_tree(variables, saved[2])
  *_, variables, step = runs.load_run(str(tmp_path / "run"), step=1)
  assert step == 1
  _assert_same_tree(variables, saved[1])
  with pytest.raises(MissingPathError, match="no checkpoint of step 3; its "
                     "steps: 1, 2"):
    runs.load_run(str(tmp_path / "run"), step=3)
  with pytest.raises(MissingPathError, match="holds no config.json"):
    runs.load_run(str(tmp_path))  # the directory above a run
  assert saving.is_dir()


@pytest.mark.parametrize("flag, needle", [
    ("--lengths=64,128,256", "flag --lengths="),         # parsed, then refused
    ("--step=3", "--step=3: "),
])
def test_evaluate_refuses_bad_flags_before_any_work(tmp_path, flag, needle):
  run_dirs.write_run(str(tmp_path / "run"), steps=(1, 2))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.evaluate",
       f"--workdir={tmp_path / 'run'}", flag], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=120, check=False)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr
  assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
  if flag == "--step=3":
    assert lines[0].endswith("its steps: 1, 2"), lines[0]
  assert not (tmp_path / "run" / "eval.json").exists()
