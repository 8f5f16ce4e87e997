r"""Generate completions from a training run or a hub checkpoint.

  python -m experiments.generate --workdir=runs/demo --prompt="def "
  python -m experiments.generate --workdir=runs/demo --prompt="import " \
      --n=4 --temperature=0.8 --top_p=0.95 --seed=1 --max_tokens=64
  python -m experiments.generate --workdir=runs/mtp_growth/copy/joint \
      --prompt="def " --mtp_draft=3        # MTP speculative decoding
  python -m experiments.generate --hf_path=/path/to/ckpt --prompt_ids=1,42,7
  python -m experiments.generate --preset=tiny --prompt="a"   # random weights

RUN is an experiments.pretrain / mtp_growth work directory: its newest
checkpoint and its tokenizer are used, the prompt is BOS + the encoded text,
and a sample ends at EOS (or --max_tokens). A hub checkpoint carries no
tokenizer m2jax can read: give token ids. All logic is in m2jax.infer.
"""

import dataclasses
import time

from absl import flags, logging
import numpy as np

from experiments import cli, engine_flags, run_flags
from m2jax.errors import UserError
from m2jax.infer.engine import Engine, EngineConfig
from m2jax.infer.sampling import SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", None, "Prompt text (needs the run's tokenizer).")
flags.DEFINE_list("prompt_ids", None, "Prompt token ids instead of text.")
flags.DEFINE_integer("max_tokens", 64, "New tokens per sample at most.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus mass.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: all).")
flags.DEFINE_integer("seed", None, "Random seed (default: drawn).")
flags.DEFINE_integer("n", 1, "Samples of the prompt.")
flags.DEFINE_multi_string("stop", [], "Stop strings (repeatable).")
flags.DEFINE_bool("logprobs", False, "Print token ids and log-probs.")
engine_flags.define()  # --workdir/--hf_path/--preset, the KV cache, MTP
run_flags.define()  # --mesh, the Settings flags, multi-host


def _prompt(tokenizer):
  if (FLAGS.prompt is None) == (FLAGS.prompt_ids is None):
    raise UserError("give exactly one of --prompt and --prompt_ids")
  if FLAGS.prompt_ids is not None:
    try:
      return [int(t) for t in FLAGS.prompt_ids]
    except ValueError:
      raise UserError(f"--prompt_ids: integers separated by commas, got "
                      f"{FLAGS.prompt_ids}") from None
  if tokenizer is None:
    raise UserError("--prompt needs a tokenizer: hub checkpoints have none "
                    "m2jax reads; give --prompt_ids")
  return [tokenizer.bos_id] + list(np.asarray(tokenizer.encode(FLAGS.prompt)))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  mesh, settings = run_flags.from_flags()
  params = SamplingParams(
      temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
      seed=FLAGS.seed, max_tokens=FLAGS.max_tokens, n=FLAGS.n,
      stop=tuple(FLAGS.stop))
  cfg, variables, tokenizer, source = engine_flags.load()
  prompt = _prompt(tokenizer)
  if tokenizer is not None:
    params = dataclasses.replace(params, stop_token_ids=(tokenizer.eos_id,))
  engine = Engine(cfg.replace(settings=settings), variables,
                  EngineConfig(page_size=FLAGS.page_size,
                               num_pages=FLAGS.num_pages,
                               max_batch=max(FLAGS.n, 1),
                               mtp_draft=FLAGS.mtp_draft),
                  tokenizer=tokenizer, mesh=mesh)
  start = time.perf_counter()
  [samples] = engine.generate([prompt], params)
  seconds = time.perf_counter() - start
  print(f"# {source}: {len(prompt)} prompt tokens, {FLAGS.n} sample(s)")
  for i, s in enumerate(samples):
    text = (tokenizer.decode(np.asarray(s.tokens)) if tokenizer is not None
            else " ".join(map(str, s.tokens)))
    print(f"--- sample {i} ({len(s.tokens)} tokens, {s.finish_reason}) ---")
    print((FLAGS.prompt or "") + text)
    if FLAGS.logprobs:
      print("tokens:", s.tokens)
      print("logprobs:", [round(x, 4) for x in s.logprobs])
  total = sum(len(s.tokens) for s in samples)
  st = engine.stats
  line = (f"# {total} tokens in {seconds:.2f} s (compilation included), "
          f"{st['decode_steps']} decode steps")
  if FLAGS.mtp_draft:
    line += (f", draft acceptance {st['accepted'] / max(st['drafted'], 1):.2f}"
             f" ({st['accepted']} of {st['drafted']})")
  print(line)


if __name__ == "__main__":
  cli.run(main)
