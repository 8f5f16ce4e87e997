"""Flags of the scripts that generate (experiments.generate, .serve): where
the model comes from and how the engine caches it.

  engine_flags.define()                        # at import of the script
  cfg, variables, tokenizer, source = engine_flags.load()   # in main

The model is one of: --workdir, a pretrain / mtp_growth run directory (its
newest checkpoint and its tokenizer); --hf_path, a hub checkpoint (no
tokenizer m2jax reads: token ids only); --preset, random weights of a preset
(the byte tokenizer; for benchmarks and smoke tests). All logic is in m2jax.
"""

from absl import flags
import jax

from m2jax import config as config_lib
from m2jax import hf, model
from m2jax.data import ByteTokenizer
from m2jax.errors import UserError
from m2jax.eval import runs

FLAGS = flags.FLAGS


def define() -> None:
  flags.DEFINE_string("workdir", None, "A pretrain/mtp_growth run directory.")
  flags.DEFINE_string("hf_path", None, "A hub checkpoint directory instead.")
  flags.DEFINE_string("preset", None, "Random weights of a model preset "
                      "instead (byte tokenizer), e.g. tiny.")
  flags.DEFINE_integer("mtp_draft", 0,
                       "MTP speculative draft tokens per step.")
  flags.DEFINE_integer("page_size", 16, "KV cache page size (tokens).")
  flags.DEFINE_integer("num_pages", 512, "KV cache pages.")


def load():
  """(model config, variables, tokenizer or None, a line naming the source)
  of the model the flags name."""
  given = [n for n in ("workdir", "hf_path", "preset")
           if FLAGS[n].value is not None]
  if len(given) != 1:
    raise UserError("give exactly one of --workdir, --hf_path and --preset")
  if FLAGS.workdir is not None:
    cfg, _, tokenizer, variables, step = runs.load_run(FLAGS.workdir)
    return cfg, variables, tokenizer, f"{FLAGS.workdir} (step {step})"
  if FLAGS.hf_path is not None:
    cfg, variables = hf.load(FLAGS.hf_path)
    return cfg, variables, None, FLAGS.hf_path
  cfg = config_lib.get_preset(FLAGS.preset)
  tokenizer = ByteTokenizer()
  if cfg.vocab_size < tokenizer.vocab_size:
    tokenizer = None
  return (cfg, model.init(cfg, jax.random.key(0)), tokenizer,
          f"preset {FLAGS.preset} (random weights)")
