"""Serve a model over an OpenAI-compatible HTTP API (m2jax/serve/).

  python -m experiments.serve --workdir=runs/demo           # 127.0.0.1:8000
  python -m experiments.serve --workdir=runs/demo --host=0.0.0.0 \\
      --api_key=SECRET --max_batch=64 --mtp_draft=3
  python -m experiments.serve --hf_path=/path/to/ckpt       # token ids only
  python -m experiments.serve --preset=tiny                 # random weights

The key may also come from the environment variable M2JAX_API_KEY; a host
other than loopback is refused without one. Routes: GET /v1/models, POST
/v1/completions, POST /v1/chat/completions (README, "Serving").

The recording gateway (m2jax/rl/gateway.py): every call carries a session
header, each session is committed to a data pool as one trajectory when the
agent ends it (POST /v1/sessions/{id}/end with its reward) or stored and
discarded after --session_timeout_s idle (no verifier runs here):

  python -m experiments.serve --preset=tiny --record --pool=runs/pool.sqlite
"""

import os
import time

from absl import flags, logging
import jax

from experiments import cli, engine_flags, run_flags
from m2jax.errors import UserError
from m2jax.infer.engine import EngineConfig
from m2jax.rl import gateway as gateway_lib
from m2jax.rl import pool as pool_lib
from m2jax.serve import app as app_lib
from m2jax.serve.loop import EngineLoop

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (loopback by "
                    "default; any other needs an API key).")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("api_key", None, "Bearer key every request must carry "
                    "(default: $M2JAX_API_KEY; none: no key).")
flags.DEFINE_string("model_name", None, "The model id clients name (default: "
                    "the run directory's name, or the preset's).")
flags.DEFINE_integer("max_batch", 32, "Sequences decoded together at most "
                     "(also the most samples n of one prompt).")
flags.DEFINE_integer("max_seq_len", None, "Longest prompt + completion "
                     "(default: the model's context).")
flags.DEFINE_integer("prefill_chunk", 128, "Prompt tokens per prefill call.")
flags.DEFINE_integer("decode_steps", 1, "Tokens per compiled decode call "
                     "(more: less dispatch, coarser streaming).")
flags.DEFINE_integer("policy_version", 0, "The version of the weights "
                     "served (reported in every response).")
flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning",
                                        "info", "debug"], "uvicorn's logs.")
flags.DEFINE_integer(
    "warmup_prompt_tokens", 0, "Before serving, compile the shapes that "
    "1, 2, 4, ... --max_batch concurrent requests of prompts this long meet "
    "(Engine.warmup), so the first requests wait for no compilation; 0: "
    "none (each new batch size then compiles on first use).", lower_bound=0)
flags.DEFINE_integer("warmup_new_tokens", 128, "Tokens each warm-up "
                     "request generates.", lower_bound=1)
flags.DEFINE_integer("max_body_bytes", 8 << 20, "The largest request body "
                     "(a larger one gets a 413).", lower_bound=1)
flags.DEFINE_bool("record", False, "Serve as the recording gateway: "
                  "sessions (the X-Session-Id header) are committed to "
                  "--pool as trajectories.")
flags.DEFINE_string("pool", None, "With --record: the data pool file "
                    "(created if new).")
flags.DEFINE_float("session_timeout_s", 600.0, "With --record: a session "
                   "without a call for this long ends (stored and "
                   "discarded: it has no verified outcome).")
flags.DEFINE_bool("session_required", True, "With --record: refuse calls "
                  "without the session header (else serve them "
                  "unrecorded).")
flags.DEFINE_string("record_env", "agent", "With --record: the env name of "
                    "the recorded trajectories.")
engine_flags.define()  # --workdir/--hf_path/--preset, the KV cache, MTP
run_flags.define()  # --mesh, the Settings flags, multi-host


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  api_key = FLAGS.api_key or os.environ.get("M2JAX_API_KEY") or None
  app_lib.check_host(FLAGS.host, api_key)   # before loading anything
  gateway = None
  if FLAGS.record:
    if not FLAGS.pool:
      raise UserError("--record needs --pool, the data pool file")
    gateway = gateway_lib.Gateway(pool_lib.Pool(FLAGS.pool),
                                  gateway_lib.GatewayConfig(
                                      session_timeout_s=FLAGS.session_timeout_s,
                                      require_session=FLAGS.session_required,
                                      env=FLAGS.record_env,
                                      max_body_bytes=FLAGS.max_body_bytes))
  mesh, settings = run_flags.from_flags()
  cfg, variables, tokenizer, source = engine_flags.load()
  name = FLAGS.model_name or os.path.basename(os.path.normpath(
      FLAGS.workdir or FLAGS.hf_path or FLAGS.preset))
  loop = EngineLoop(
      cfg.replace(settings=settings), variables,
      EngineConfig(page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
                   max_batch=FLAGS.max_batch, max_seq_len=FLAGS.max_seq_len,
                   prefill_chunk=FLAGS.prefill_chunk,
                   decode_steps=FLAGS.decode_steps,
                   mtp_draft=FLAGS.mtp_draft),
      tokenizer=tokenizer, mesh=mesh, policy_version=FLAGS.policy_version)
  if FLAGS.warmup_prompt_tokens:
    start = time.perf_counter()
    loop.engine.warmup(FLAGS.warmup_prompt_tokens, FLAGS.warmup_new_tokens)
    print(f"# warm-up compiled in {time.perf_counter() - start:.1f} s",
          flush=True)
  loop.start()
  device = jax.devices()[0]
  print(f"# serving {source} as {name!r} on http://{FLAGS.host}:{FLAGS.port}"
        f"/v1 ({'key required' if api_key else 'no key'}"
        f"{', recording to ' + FLAGS.pool if gateway else ''}), "
        f"{jax.device_count()} x {getattr(device, 'device_kind', device)}",
        flush=True)
  try:
    if gateway is None:
      app_lib.serve(loop, model_name=name, host=FLAGS.host, port=FLAGS.port,
                    api_key=api_key, log_level=FLAGS.log_level,
                    max_body_bytes=FLAGS.max_body_bytes)
    else:
      gateway_lib.serve(loop, gateway, model_name=name, host=FLAGS.host,
                        port=FLAGS.port, api_key=api_key,
                        log_level=FLAGS.log_level)
  finally:
    loop.stop()


if __name__ == "__main__":
  cli.run(main)
