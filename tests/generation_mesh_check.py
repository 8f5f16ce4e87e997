"""Generation on 8 fake CPU devices against one device (run by
tests/test_generation.py in its own process): greedy tokens and log-probs of
the engine on meshes with tensor and expert parallelism."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from m2jax import config as config_lib  # pylint: disable=wrong-import-position
from m2jax import model, sharding  # pylint: disable=wrong-import-position
from m2jax.infer.engine import Engine, EngineConfig  # pylint: disable=wrong-import-position
from m2jax.infer.sampling import SamplingParams  # pylint: disable=wrong-import-position
from m2jax.settings import Settings  # pylint: disable=wrong-import-position


def main():
  assert jax.device_count() == 8, jax.devices()
  cfg = config_lib.TINY.replace(num_mtp_modules=1,
                                settings=Settings(attention="xla"))
  v = model.init(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 200, n)) for n in (5, 11, 3)]
  ec = EngineConfig(page_size=4, num_pages=32, max_batch=4, prefill_chunk=8,
                    mtp_draft=1)
  params = SamplingParams(temperature=0, max_tokens=5)
  ref = Engine(cfg, v, ec).generate(prompts, params)
  result = {}
  for spec in ("tensor=2,expert=4", "data=2,expert=2,tensor=2"):
    mesh = sharding.make_mesh(spec)
    got = Engine(cfg, v, ec, mesh=mesh).generate(prompts, params)
    result[spec] = {
        "tokens_equal": [g[0].tokens == r[0].tokens
                         for g, r in zip(got, ref)],
        "logprob_diff": max(float(np.max(np.abs(
            np.asarray(g[0].logprobs) - np.asarray(r[0].logprobs))))
                            for g, r in zip(got, ref))}
  json.dump(result, sys.stdout)


if __name__ == "__main__":
  main()
