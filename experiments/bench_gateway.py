"""The recording gateway under load, and SIGKILLed mid-run (issue 16):
--sessions concurrent black-box sessions (the `openai` client only)
against `python -m experiments.serve --record` in a process of its own,
then the same with the gateway SIGKILLed after --kill_after sessions have
ended (benchmarks/gateway_load.py says what is checked). Prints and
writes (--out) the rounds' times, the refusals' status codes and the
pool's verdicts.

  python -m experiments.bench_gateway --preset=m2_small --sessions=128 \\
      --out=benchmarks/results/gateway_h100.json
"""

import logging

from absl import flags
import jax

from benchmarks import gateway_load
from benchmarks import timing
from experiments import cli
from m2jax.train import checkpoint

_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset the gateway "
                              "serves (random weights: the load, not the "
                              "skill).")
_SESSIONS = flags.DEFINE_integer("sessions", 128, "Concurrent sessions.",
                                 lower_bound=1)
_CALLS = flags.DEFINE_integer("calls", 3, "Calls per session.",
                              lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Tokens per call.",
                                   lower_bound=1)
_KILL_AFTER = flags.DEFINE_integer("kill_after", None, "SIGKILL the gateway "
                                   "once this many sessions of the kill "
                                   "round have ended (default: half).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 128, "Gateway: sequences "
                                  "decoded at once.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 2048, "Gateway: KV pages.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Gateway: page tokens.")
_MAX_SEQ = flags.DEFINE_integer("max_seq_len", 512, "Gateway: prompt + "
                                "completion at most.")
_BODY = flags.DEFINE_integer("max_body_bytes", 1 << 20, "Gateway: largest "
                             "request body.")
_START = flags.DEFINE_float("start_timeout_s", 300.0, "Seconds the gateway "
                            "may take to load and compile.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_gateway", "Where the "
                               "gateway's pool is written.")
_OUT = flags.DEFINE_string("out", None, "JSON results.")


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per call
  serve_args = [f"--preset={_PRESET.value}", f"--max_batch={_MAX_BATCH.value}",
                f"--num_pages={_NUM_PAGES.value}",
                f"--page_size={_PAGE_SIZE.value}",
                f"--max_seq_len={_MAX_SEQ.value}"]
  out = gateway_load.run(
      serve_args, _WORKDIR.value, sessions=_SESSIONS.value,
      calls=_CALLS.value, max_tokens=_MAX_TOKENS.value,
      kill_after=_KILL_AFTER.value or max(1, _SESSIONS.value // 2),
      model=_PRESET.value, start_timeout_s=_START.value,
      max_body_bytes=_BODY.value)
  out = {**timing.run_header(), "preset": _PRESET.value, **out}
  for name in ("load", "kill"):
    r = out[name]
    print(f"{name}: {r['sessions']} sessions, {r['acknowledged']} ended, "
          f"{r['errors']} errors, {r['wall_s']:.1f} s "
          f"({r['sessions_per_s']:.1f} sessions/s, "
          f"{r['tokens_per_s']:.0f} tokens/s); pool: {r['pool']}",
          flush=True)
  print(f"refusals: {out['load']['refusals']}")
  print(f"kill: {out['kill'].get('killed_after')}")
  print(f"ok: {out['ok']}  ({jax.devices()[0].device_kind})", flush=True)
  if _OUT.value:
    checkpoint.write_json(_OUT.value, out)


if __name__ == "__main__":
  cli.run(main)
