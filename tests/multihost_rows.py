"""One process of a two-process run that reports which rows it reads (run by
tests/test_multihost.py, two at once, each with 4 fake CPU devices).

Joins the run, reads the first batches of the train pipeline for its own
rows of a mesh over both processes (what m2jax.train.loop reads), assembles
the global batches from them with `sharding.shard_batch` and gathers their
row ids and tokens back; prints one JSON object.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
      python tests/multihost_rows.py 127.0.0.1:PORT PROCESS_ID
"""

import json
import sys

import numpy as np
from jax.experimental import multihost_utils

from m2jax import sharding
from m2jax.data import DataConfig, make_iterator, make_tokenizer

MESH = "fsdp=2,expert=4"
DATA = DataConfig(seq_len=64, batch_size=8)
BATCHES = 3


def main(address: str, process_id: int) -> None:
  sharding.initialize_distributed(address, 2, process_id,
                                  heartbeat_timeout_s=30)
  mesh = sharding.make_mesh(MESH)
  rows = sharding.process_rows(mesh, DATA.batch_size)
  it = make_iterator(DATA, make_tokenizer(DATA), "train", rows=rows)
  local, gathered, tokens = [], [], []
  for _ in range(BATCHES):
    batch = next(it)
    local.append(batch["row_ids"].tolist())
    placed = sharding.shard_batch(batch, mesh, DATA.batch_size)
    both = multihost_utils.process_allgather(
        {k: placed[k] for k in ("row_ids", "tokens")}, tiled=True)
    gathered.append(np.asarray(both["row_ids"]).tolist())
    tokens.append(np.asarray(both["tokens"]).tolist())
  print(json.dumps({"rows": rows.tolist(), "local_row_ids": local,
                    "global_row_ids": gathered, "global_tokens": tokens,
                    "state": it.get_state()}))


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
