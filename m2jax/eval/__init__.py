"""Evaluation: synthetic long-context tasks and their exact-match scoring.

  tasks.py    RULER-style generators (NIAH single/multi-key/multi-query,
              common words, variable tracking, in-context key -> value)
  scoring.py  exact match by teacher forcing; evaluate_tasks over lengths
  recall.py   associative-recall batches and accuracy (can a config
              retrieve at all? experiments.recall_check)
  mqar.py     multi-query associative recall (Zoology's MQAR) with the
              distance between pairs and queries controlled: accuracy on
              the queried values, inside or beyond a sliding window
Validation loss in nats and bits per byte is m2jax.train.loop.evaluate.
"""

from m2jax.eval.recall import recall_accuracy, recall_batch
from m2jax.eval.scoring import evaluate_tasks, exact_match
from m2jax.eval.tasks import (TASKS, Example, eval_examples, generate,
                              training_documents)

__all__ = ["TASKS", "Example", "eval_examples", "evaluate_tasks",
           "exact_match", "generate", "recall_accuracy", "recall_batch",
           "training_documents"]
