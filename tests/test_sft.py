"""Supervised fine-tuning: chat packing, the assistant-only loss, exact
resume, the embedded set, and `experiments.sft` from a pretraining run."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.data import ByteTokenizer, DataConfig
from m2jax.data import chat
from m2jax.data import chat_sources
from m2jax.data.chat_data import ChatData
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import losses, sft
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.metrics import read_metrics

from conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A dense FFN: SFT does not touch the experts, and it compiles in about
# half the time of the MoE (the loop's MoE paths are pretraining's tests').
SMALL = ["num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
         "head_dim=8", "rotary_dim=4", "ffn_type=dense",
         "dense_intermediate_size=32"]
MCFG = config_lib.apply_overrides(config_lib.TINY, SMALL)
TOK = ByteTokenizer()
# No MTP module in the loop's tests: it would double what they compile
# (test_sft_loss_counts_assistant_targets_only covers the MTP targets).
TCFG = TrainConfig(steps=4, learning_rate=3e-3, warmup_steps=1, log_every=1,
                   eval_every=4, eval_batches=1, checkpoint_every=2,
                   mtp_depth=0)


def _conversation(i: int, tools: bool = True) -> dict:
  a, b = (7 * i) % 23, (5 * i) % 17
  messages = [{"role": "user", "content": f"add {a} {b}"}]
  if tools and i % 3 == 0:  # a tool round trip, reasoning kept in the history
    messages += [
        {"role": "assistant", "reasoning": "use it", "content": "",
         "tool_calls": [{"name": "add", "arguments": {"a": a, "b": b}}]},
        {"role": "tool", "content": str(a + b)}]
  messages.append({"role": "assistant", "reasoning": f"{a}+{b}",
                   "content": str(a + b)})
  return {"messages": messages}


CONVERSATIONS = [_conversation(i) for i in range(40)]


def _data(seq_len=256, batch_size=2, conversations=None, **kw) -> ChatData:
  convs = conversations or {"train": CONVERSATIONS[:32],
                            "validation": CONVERSATIONS[32:]}
  config = DataConfig(source="in-memory", seq_len=seq_len,
                      batch_size=batch_size, num_threads=0,
                      prefetch_batches=0, **kw)
  return ChatData(config, TOK, conversations=convs)


def _segments(batch):
  """(tokens, loss_mask, positions) of every segment of every row."""
  out = []
  for r in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in np.unique(seg[seg > 0]):
      at = seg == s
      out.append((batch["tokens"][r][at], batch["loss_mask"][r][at],
                  batch["positions"][r][at]))
    pad = seg == 0
    assert (batch["tokens"][r][pad] == TOK.pad_id).all()
    assert not batch["loss_mask"][r][pad].any()
  return out


def test_packing_keeps_each_conversation_whole_with_its_mask():
  data = _data()
  rendered = [chat.render(c["messages"], TOK) for c in CONVERSATIONS[32:]]
  seen = []
  for batch in data.validation_batches():
    assert batch["tokens"].shape == (2, 256)
    for tokens, mask, positions in _segments(batch):
      np.testing.assert_array_equal(positions, np.arange(len(tokens)))
      match = [i for i, (ids, m) in enumerate(rendered)
               if np.array_equal(ids, tokens)]
      assert len(match) == 1, TOK.decode(tokens)
      np.testing.assert_array_equal(mask, rendered[match[0]][1])
      seen += match
    # Byte tokenizer: one byte per assistant target (BOS is never one).
    np.testing.assert_array_equal(batch["num_bytes"],
                                  batch["loss_mask"].sum(1))
  assert sorted(seen) == list(range(len(rendered)))  # each exactly once
  # Train rows: whole rendered conversations too (shuffled, repeated).
  train_ids = {tuple(chat.render(c["messages"], TOK)[0])
               for c in CONVERSATIONS[:32]}
  it = data.train_iterator()
  for _ in range(6):
    for tokens, _, _ in _segments(next(it)):
      assert tuple(tokens) in train_ids


def test_each_process_reads_its_own_rows_of_the_same_batches():
  data = _data()
  whole, first, second = (data.train_iterator(rows=rows)
                          for rows in (None, [0], [1]))
  for _ in range(3):
    batch, a, b = next(whole), next(first), next(second)
    for key in batch:
      np.testing.assert_array_equal(batch[key][:1], a[key])
      np.testing.assert_array_equal(batch[key][1:], b[key])
  # Validation too, and the iterator state does not depend on the rows.
  assert whole.get_state() == first.get_state()
  for batch, a in zip(data.validation_batches(),
                      data.validation_batches(rows=[1])):
    np.testing.assert_array_equal(batch["tokens"][1:], a["tokens"])


def test_a_conversation_longer_than_a_row_is_truncated_with_a_warning():
  long = {"messages": [{"role": "user", "content": "x" * 50},
                       {"role": "assistant", "content": "y" * 50}]}
  data = _data(seq_len=64,
               conversations={"train": [long], "validation": [long]})
  with pytest.warns(UserWarning, match="cut to their first 64"):
    batch = next(iter(data.validation_batches()))
  ids, mask = chat.render(long["messages"], TOK)
  np.testing.assert_array_equal(batch["tokens"][0], ids[:64])
  np.testing.assert_array_equal(batch["loss_mask"][0], mask[:64])


def _fake_output(batch, seed=0):
  B, T = batch["tokens"].shape
  rng = np.random.default_rng(seed)
  logits = lambda: rng.normal(size=(B, T, 259)).astype(np.float32)
  return model.ModelOutput(logits(), (logits(),), np.zeros((B, T, 1)),
                           None, None)


def test_sft_loss_counts_assistant_targets_only():
  batch = next(iter(_data().validation_batches()))
  out = _fake_output(batch)
  kw = dict(mtp_weight=0.3, aux_coef=0.0, z_coef=0.0)
  base, metrics = losses.total_loss(out, batch, **kw)
  seg, mask = batch["segment_ids"][0], batch["loss_mask"][0]
  # A user token inside a conversation, and an assistant one, both targets
  # of the position before them.
  user = next(t for t in range(1, 256) if seg[t] == seg[t - 1] != 0
              and not mask[t])
  assistant = int(np.flatnonzero(mask)[0])

  def loss_with(t):  # the logits stay: only the target at t changes
    changed = dict(batch, tokens=batch["tokens"].copy())
    changed["tokens"][0, t] = (changed["tokens"][0, t] + 1) % 256
    return losses.total_loss(out, changed, **kw)

  loss_u, metrics_u = loss_with(user)
  assert float(loss_u) == float(base)
  assert float(metrics_u["mtp/ce"]) == float(metrics["mtp/ce"])
  loss_a, metrics_a = loss_with(assistant)
  assert float(metrics_a["ce"]) != float(metrics["ce"])
  # Pretraining's batches (no loss_mask) count the user token.
  plain = {k: v for k, v in batch.items() if k != "loss_mask"}
  changed = dict(plain, tokens=plain["tokens"].copy())
  changed["tokens"][0, user] = (changed["tokens"][0, user] + 1) % 256
  assert float(losses.total_loss(out, changed, **kw)[0]) != float(
      losses.total_loss(out, plain, **kw)[0])
  # The target count of the loss and of the eval step: assistant targets.
  same = (seg[1:] == seg[:-1]) & (seg[1:] != 0)
  want = int((same & (mask[1:] != 0)).sum()) + int(
      ((batch["segment_ids"][1, 1:] == batch["segment_ids"][1, :-1])
       & (batch["segment_ids"][1, 1:] != 0)
       & (batch["loss_mask"][1, 1:] != 0)).sum())
  assert int(metrics["tokens"]) == want
  _, eval_fn = step_lib.jit_steps(MCFG, TCFG)
  evaluated = eval_fn(state_lib.init_state(MCFG, TCFG, _variables()), batch)
  assert int(evaluated["tokens"]) == want


def _variables():
  """Random variables of MCFG's layout without compiling model.init (a
  fresh copy each call: the loop donates the starting buffers)."""
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: model.init(MCFG, jax.random.key(0)))
  return jax.tree.map(
      lambda x: (np.ones(x.shape, x.dtype) if len(x.shape) == 1 else
                 0.02 * rng.standard_normal(x.shape).astype(x.dtype)),
      shapes)


def _init() -> sft.Init:
  return sft.Init(MCFG, _variables(), TOK, {})


def test_resume_equals_an_uninterrupted_run(tmp_path):
  full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
  ref = sft.finetune(MCFG, TCFG, _data(), full, init=_init(), progress=False)
  sft.finetune(MCFG, TCFG, _data(), cut, init=_init(), progress=False,
               stop_after=2)
  # The checkpoint replaces the init's variables (given here only so that
  # the resumed run does not compile model.init for a state it discards).
  resumed = sft.finetune(MCFG, TCFG, _data(), cut, init=_init(), resume=True,
                         progress=False)
  timeless = lambda workdir: [
      {k: v for k, v in line.items() if k != "tokens_per_sec"}
      for line in read_metrics(workdir)]
  assert timeless(cut) == timeless(full)
  jax.tree.map(np.testing.assert_array_equal, resumed["state"].params,
               ref["state"].params)
  # The logged target counts are the assistant targets of the batches.
  it = _data().train_iterator()
  for line, batch in zip([l for l in read_metrics(full) if "ce" in l],
                         (next(it) for _ in range(4))):
    seg, mask = batch["segment_ids"], batch["loss_mask"]
    want = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
            & (mask[:, 1:] != 0)).sum()
    assert line["tokens"] == want
  with pytest.raises(FileNotFoundError, match="--init"):
    sft.finetune(MCFG, TCFG, _data(), str(tmp_path / "none"), resume=True,
                 progress=False)


def test_the_embedded_set_is_deterministic_and_split_by_module():
  pairs = chat_sources.stdlib_functions()
  assert len(pairs) > 300
  for key, conv in pairs[:50]:
    user, assistant = conv["messages"]
    assert user["content"].startswith("Write a Python function `")
    assert assistant["content"].startswith(("def ", "async def ", "@"))
    ids, _ = chat.render(conv["messages"], TOK)
    assert len(ids) <= chat_sources.MAX_BYTE_TOKENS
  splits = chat_sources.split_conversations(
      DataConfig(validation_fraction=0.1))
  assert len(splits["train"]) + len(splits["validation"]) == len(pairs)
  held = {json.dumps(c) for c in splits["validation"]}
  modules = {}
  for key, conv in pairs:
    modules.setdefault(key, set()).add(json.dumps(conv) in held)
  assert all(len(sides) == 1 for sides in modules.values())
  assert 0 < len(held) < len(pairs) // 4


def test_a_hub_checkpoint_starts_with_the_mtp_modules_it_has(tmp_path):
  path = os.path.join(ROOT, "tests", "fixtures", "hf_tiny_fp8")
  init = sft.load_hub(path)
  # The fixture declares 3 MTP modules and holds none (as the released M2).
  assert init.model_config.num_mtp_modules == 0
  assert init.model_config.param_dtype == "float32"
  shapes = jax.eval_shape(lambda: model.init(init.model_config,
                                             jax.random.key(0)))
  assert jax.tree.structure(shapes) == jax.tree.structure(init.variables)
  assert isinstance(init.tokenizer, ByteTokenizer)
  TOK.save(str(tmp_path / "tok"))
  assert sft.load_hub(path, str(tmp_path / "tok")).origin["tokenizer"] == str(
      tmp_path / "tok")


def _pretraining_run(workdir: str) -> None:
  """A run directory as experiments.pretrain leaves it (config.json,
  tokenizer/, a checkpoint at step 4) of a freshly initialised model."""
  tcfg = TrainConfig(steps=4)
  dcfg = DataConfig(seq_len=32, batch_size=2)
  meta = {"model": config_lib.config_to_dict(MCFG),
          "train": config_lib.config_to_dict(tcfg),
          "data": config_lib.config_to_dict(dcfg)}
  os.makedirs(workdir)
  TOK.save(os.path.join(workdir, "tokenizer"))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(meta, f)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=1)
  checkpointer.save(4, state_lib.init_state(MCFG, tcfg, _variables()), {},
                    meta)
  checkpointer.close()


def test_cli_fine_tunes_a_pretraining_run_and_held_out_loss_falls(tmp_path):
  init = str(tmp_path / "pretrain")
  _pretraining_run(init)
  chats = tmp_path / "chats.jsonl"
  with open(chats, "w") as f:
    for i in range(200):
      f.write(json.dumps(_conversation(i, tools=False)) + "\n")
  workdir = str(tmp_path / "sft")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=FAST_COMPILE)  # one device
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.sft", f"--workdir={workdir}",
       f"--init={init}", f"--data={chats}", "--seq_len=128",
       "--batch_size=4", "--steps=30", "--eval_every=30", "--log_every=10",
       "--learning_rate=3e-3", "--warmup_steps=2", "--mtp_depth=0",
       "--sample_tokens=0"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  evals = [l for l in read_metrics(workdir) if "val_loss" in l]
  assert [l["step"] for l in evals] == [0, 30]
  assert evals[1]["val_loss"] < 0.6 * evals[0]["val_loss"], evals
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  assert saved["data"]["source"] == str(chats)
  assert saved["model"] == config_lib.config_to_dict(MCFG)
  with open(os.path.join(workdir, sft.INIT_FILE)) as f:
    assert json.load(f) == {"init": os.path.abspath(init), "step": 4}
  assert os.path.exists(os.path.join(workdir, "tokenizer",
                                     "tokenizer_config.json"))
  # --resume keeps the run's configs: a contradicting flag is refused in one
  # line naming the field, before any work.
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.sft", f"--workdir={workdir}",
       "--resume", "--seq_len=64"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=300, check=False)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "DataConfig.seq_len: the run has 128 but --seq_len=64" in proc.stderr
  assert "Traceback" not in proc.stderr
