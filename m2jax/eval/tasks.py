"""Synthetic long-context tasks in the spirit of RULER, generated in code.

Each generator returns an `Example(prompt, answer)` whose prompt is about
`length` characters long (= tokens for the byte tokenizer). The answer is
the exact text the model must produce after the prompt; scoring is exact
match (m2jax.eval.scoring). Tasks:

  niah_single        one needle ("The magic number for KEY is VALUE.") hidden
                     at a random depth of filler text; asked for at the end.
  niah_multikey      several needles with different keys; one is asked for.
  niah_multiquery    several needles; all of them are asked for, in order.
  cwe                common-word extraction: a list where a few words repeat
                     many times; name the most common ones (in order).
  variable_tracking  multi-hop: X1 = number, X2 = X1, ...; name every
                     variable that holds the number.
  icl_kv             few-shot in-context learning of a random key -> value
                     mapping: the query key's value appears only in context.

The same generators make training documents (`training_documents`) with
seeds disjoint from evaluation's, so a model can learn the formats. A
fraction of the training documents can be *drills* (`recall_drill`,
`kv_drill`): the same needle and key -> value formats, but every fact is
asked for, so a third of the document's tokens are retrieval targets instead
of the few answer tokens of one question. Small models need that density to
learn retrieval at all within a sweep's token budget (a 4-layer model
trained on the evaluation formats alone never did; benchmarks/results/
ablations/README.md). Drills are never evaluated.
"""

from __future__ import annotations

import dataclasses
import random
import string

from m2jax.config import ConfigError

TASKS = ("niah_single", "niah_multikey", "niah_multiquery", "cwe",
         "variable_tracking", "icl_kv")

# Shortest prompt every task fits in (characters).
MIN_LENGTH = 128

# Seeds below EVAL_SEED_BASE make training data, at or above it evaluation.
EVAL_SEED_BASE = 10**9

_WORDS = ("river", "stone", "cloud", "amber", "forest", "silver", "window",
          "garden", "candle", "harbor", "meadow", "copper", "lantern",
          "orchard", "pepper", "saddle", "thunder", "velvet", "willow",
          "anchor", "basket", "cobalt", "dragon", "ember", "falcon", "glacier")
_NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.",
          "Here we go.", "There and back again.", "Time flies like an arrow.")


@dataclasses.dataclass(frozen=True)
class Example:
  task: str
  length: int
  prompt: str
  answer: str


def _key(rng: random.Random, n: int = 6) -> str:
  return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


def _number(rng: random.Random) -> str:
  return str(rng.randrange(10**5, 10**6))


def _filler(rng: random.Random, n_chars: int) -> list[str]:
  out, total = [], 0
  while total < n_chars:
    s = rng.choice(_NOISE)
    out.append(s)
    total += len(s) + 1
  return out


def _haystack(rng: random.Random, needles: list[str], question: str,
              length: int) -> str:
  """Filler of about `length` chars, needles at random depths, question."""
  budget = max(length - len(question) - sum(len(n) + 1 for n in needles), 0)
  sentences = _filler(rng, budget)
  # Random depths, needles kept in their order (a variable chain must read
  # forwards).
  slots = sorted(rng.randrange(len(sentences) + 1) for _ in needles)
  for slot, needle in reversed(list(zip(slots, needles))):
    sentences.insert(slot, needle)
  return " ".join(sentences) + " " + question


def niah_single(rng, length):
  key, value = _key(rng), _number(rng)
  needle = f"The magic number for {key} is {value}."
  q = f"What is the magic number for {key}? Answer:"
  return _haystack(rng, [needle], q, length), f" {value}."


def niah_multikey(rng, length):
  n_keys = 4 if length >= 256 else 2
  keys = [_key(rng) for _ in range(n_keys)]
  values = [_number(rng) for _ in keys]
  needles = [f"The magic number for {k} is {v}." for k, v in zip(keys, values)]
  i = rng.randrange(n_keys)
  q = f"What is the magic number for {keys[i]}? Answer:"
  return _haystack(rng, needles, q, length), f" {values[i]}."


def niah_multiquery(rng, length):
  n_keys = 3 if length >= 256 else 2
  keys = [_key(rng) for _ in range(n_keys)]
  values = [_number(rng) for _ in keys]
  needles = [f"The magic number for {k} is {v}." for k, v in zip(keys, values)]
  q = f"What are the magic numbers for {', '.join(keys)}? Answer:"
  return _haystack(rng, needles, q, length), " " + " ".join(values) + "."


def cwe(rng, length, n_common=3):
  """Rare words appear `base` times each; the 3 common ones strictly more."""
  q = " Most common 3 words, most frequent first:"
  avg = sum(len(w) + 1 for w in _WORDS) / len(_WORDS)
  n = max(int((length - len(q) - 8) / avg), 11)
  n_rare = max(2, min(len(_WORDS) - n_common, n // 5))
  base = max(1, n // (3 * n_rare))
  top = max(base + 3, (n - base * n_rare) // n_common)
  step = max(1, (top - base - 1) // n_common)
  words = rng.sample(_WORDS, n_common + n_rare)
  common, rare = words[:n_common], words[n_common:]
  counts = {w: base for w in rare}
  for j, w in enumerate(common):
    counts[w] = top - j * step
  items = [w for w, c in counts.items() for _ in range(c)]
  rng.shuffle(items)
  return "Words: " + " ".join(items) + "." + q, " " + " ".join(common) + "."


def variable_tracking(rng, length, n_hops=4):
  value = _number(rng)
  names = [_key(rng, 4).upper() for _ in range(n_hops)]
  chain = [f"VAR {names[0]} = {value}."]
  chain += [f"VAR {names[i]} = {names[i - 1]}." for i in range(1, n_hops)]
  q = f"Which variables hold {value}? Answer:"
  return _haystack(rng, chain, q, length), " " + " ".join(names) + "."


def icl_kv(rng, length):
  """key -> value pairs; the queried key appeared once, early in context."""
  q_key, q_val = _key(rng, 5), _key(rng, 5)
  lines = [f"{q_key} -> {q_val}"]
  total = len(lines[0])
  while total < length - 20:
    k, v = _key(rng, 5), _key(rng, 5)
    lines.append(f"{k} -> {v}")
    total += len(lines[-1]) + 1
  # The first pair is the answer; move it into the first quarter.
  first = lines.pop(0)
  lines.insert(rng.randrange(max(1, len(lines) // 4)), first)
  return "\n".join(lines) + f"\n{q_key} ->", f" {q_val}\n"


def recall_drill(rng, length):
  """Needles in filler, then every needle asked for with its answer."""
  n = max(2, length // 120)
  keys = [_key(rng) for _ in range(n)]
  values = [_number(rng) for _ in keys]
  needles = [f"The magic number for {k} is {v}." for k, v in zip(keys, values)]
  order = rng.sample(range(n), n)
  qa = " ".join(f"What is the magic number for {keys[i]}? Answer: {values[i]}."
                for i in order)
  return _haystack(rng, needles, "", length - len(qa)).rstrip() + " " + qa


def kv_drill(rng, length):
  """key -> value pairs, then all of them again in another order."""
  pairs = [(_key(rng, 5), _key(rng, 5))
           for _ in range(max(2, (length + 1) // 30))]  # 2 lines of 15
  again = rng.sample(pairs, len(pairs))
  return "\n".join(f"{k} -> {v}" for k, v in pairs + again)


DRILLS = {"recall_drill": recall_drill, "kv_drill": kv_drill}

_GENERATORS = {
    "niah_single": niah_single, "niah_multikey": niah_multikey,
    "niah_multiquery": niah_multiquery, "cwe": cwe,
    "variable_tracking": variable_tracking, "icl_kv": icl_kv,
}


def generate(task: str, length: int, seed: int) -> Example:
  """One example of `task` with a prompt of about `length` characters."""
  if task not in _GENERATORS:
    raise ConfigError(f"unknown task {task!r}; tasks: {TASKS}")
  if length < MIN_LENGTH:
    raise ConfigError(f"length must be >= {MIN_LENGTH} characters, got "
                      f"{length}")
  prompt, answer = _GENERATORS[task](random.Random(f"{task}/{length}/{seed}"),
                                     length)
  return Example(task, length, prompt, answer)


def eval_examples(task: str, length: int, n: int) -> list[Example]:
  """The fixed evaluation set of `task` at `length` (seeds >= EVAL_SEED_BASE)."""
  return [generate(task, length, EVAL_SEED_BASE + i) for i in range(n)]


def training_documents(n: int, lengths: list[int], seed: int = 0,
                       tasks=TASKS, drill_fraction: float = 0.0) -> list[str]:
  """`n` documents over `lengths` (train seeds): prompt+answer of `tasks`,
  and a `drill_fraction` of them drills (alternating `DRILLS`)."""
  if not 0.0 <= drill_fraction < 1.0:
    raise ConfigError(
        f"drill_fraction must be in [0, 1), got {drill_fraction}")
  rng = random.Random(seed)
  drills = list(DRILLS.values())
  docs = []
  for i in range(n):
    length = rng.choice(lengths)
    # No draw without drills: the documents of drill_fraction=0 stay those
    # of earlier versions (and earlier sweeps' validation sets).
    if drill_fraction and rng.random() < drill_fraction:
      drill = drills[len(docs) % len(drills)]
      docs.append(drill(random.Random(f"drill/{seed * n + i}"), length))
      continue
    ex = generate(tasks[i % len(tasks)], length, seed * n + i)
    docs.append(ex.prompt + ex.answer)
  return docs
