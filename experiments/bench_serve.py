"""Serving under load (issue 14): 64 concurrent streaming clients against
`experiments.serve`: throughput, p50 / p99 time to first token, and counts
showing that no request was lost or corrupted (benchmarks/serve_load.py).

  python -m experiments.bench_serve --workdir=runs/m2_small \\
      --out=benchmarks/results/serve_h100.json
  python -m experiments.bench_serve --preset=tiny --clients=4 \\
      --requests_per_client=2 --prompt_tokens=8 --max_tokens=8 \\
      --out=/tmp/serve.json                     # CPU smoke run

The server runs in its own process (its flags: --serve_flags); the clients
send greedy streams of random token-id prompts (printable bytes for the byte
tokenizer), each prompt from several clients.
"""

import datetime
import json
import os
import shlex
import shutil
import tempfile

from absl import flags, logging
import numpy as np

from benchmarks import serve_load
from experiments import cli
from m2jax.data import ByteTokenizer, make_tokenizer
from m2jax.errors import UserError
from m2jax.eval import runs

_WORKDIR = flags.DEFINE_string("workdir", None, "A pretrain run directory.")
_PRESET = flags.DEFINE_string("preset", None,
                              "Random weights of a preset instead.")
_CLIENTS = flags.DEFINE_integer("clients", 64, "Concurrent clients.")
_REQUESTS = flags.DEFINE_integer("requests_per_client", 4,
                                 "Requests each client sends, one by one.")
_PROMPTS = flags.DEFINE_integer("prompts", 32, "Distinct prompts.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 128,
                                      "Tokens per prompt (BOS included).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "New tokens at most.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "KV page size.")
_SERVE_FLAGS = flags.DEFINE_string(
    "serve_flags", "", "More flags for experiments.serve (e.g. "
    "--decode_steps=4 --mtp_draft=3).")
_WARMUP = flags.DEFINE_bool("warmup", True, "Untimed 1, 2, 4, ... concurrent "
                            "requests first (each batch bucket compiles), "
                            "then the load twice, the second reported (the "
                            "first is kept as cold_pass).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/serve.json",
                           "JSON results.")


def _tokenizer():
  if _WORKDIR.value:
    _, _, dcfg = runs.load_configs(_WORKDIR.value)
    return make_tokenizer(dcfg, os.path.join(_WORKDIR.value, "tokenizer"))
  return ByteTokenizer()


def _prompts(tokenizer) -> list[list[int]]:
  rng = np.random.default_rng(0)
  lo, hi = ((32, 127) if isinstance(tokenizer, ByteTokenizer)
            else (3, tokenizer.vocab_size))
  return [[tokenizer.bos_id] + [int(t) for t in rng.integers(
      lo, hi, _PROMPT_TOKENS.value - 1)] for _ in range(_PROMPTS.value)]


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)   # no line per HTTP request
  if (_WORKDIR.value is None) == (_PRESET.value is None):
    raise UserError("give exactly one of --workdir and --preset")
  for flag in (_CLIENTS, _REQUESTS, _PROMPTS, _MAX_TOKENS):
    if flag.value < 1:
      raise UserError(f"--{flag.name} must be >= 1 (got {flag.value})")
  if _PROMPT_TOKENS.value < 2:
    raise UserError("--prompt_tokens must be >= 2 (BOS and one more)")
  tokenizer = _tokenizer()
  prompts = _prompts(tokenizer)
  S = _PAGE_SIZE.value
  per_seq = -(-(_PROMPT_TOKENS.value + _MAX_TOKENS.value) // S) + 1
  source = (f"--workdir={_WORKDIR.value}" if _WORKDIR.value
            else f"--preset={_PRESET.value}")
  serve_args = [source, f"--max_batch={_CLIENTS.value}",
                f"--page_size={S}",
                f"--num_pages={_CLIENTS.value * per_seq + 2}",
                *shlex.split(_SERVE_FLAGS.value)]
  log_dir = tempfile.mkdtemp(prefix="bench_serve_")
  log_path = os.path.join(log_dir, "server.log")
  proc, url, key, banner, model = serve_load.start_server(serve_args,
                                                          log_path)
  ready = os.path.getsize(log_path)
  print(banner, flush=True)
  try:
    result = serve_load.run_load(
        url, key, model, prompts, clients=_CLIENTS.value,
        requests_per_client=_REQUESTS.value, max_tokens=_MAX_TOKENS.value,
        tokenizer=tokenizer, warmup=_WARMUP.value)
  finally:
    serve_load.stop_server(proc)
  # What the server compiled after it said it was ready: shapes its
  # warm-up (and --warmup's passes, when on) did not cover.
  late = serve_load.compiles_in(log_path, after=ready)
  shutil.rmtree(log_dir, ignore_errors=True)
  result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "server": banner, "serve_flags": serve_args, **result,
            "compiles_after_ready": len(late),
            "compiled_after_ready": late[:20]}
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps({k: v for k, v in result.items() if k != "problems"},
                   indent=1))
  for p in result["problems"]:
    print("problem:", p)


if __name__ == "__main__":
  cli.run(main)
