"""Supervised fine-tuning: the pretraining loop on chat data, assistant loss.

Between pretraining and RL, the model learns the chat template
(m2jax/data/chat.py) from conversations: m2jax/data/chat_data.py renders
and packs them (one conversation per segment) and gives every batch the
assistant mask as its `loss_mask`, so the next-token loss at position t
counts iff token t+1 is an assistant token (its reasoning, content, tool
calls and end of turn), at every MTP depth too. The loop is pretraining's
(m2jax.train.loop.pretrain: checkpoints, exact resume, metrics.jsonl,
TensorBoard, meshes), and its val_loss is the held-out assistant-token loss.

A run starts from
  a pretraining run directory   `load_init`: its config.json, its newest
                                checkpoint's parameters and expert bias,
                                and its tokenizer (the one SFT must use);
  a hub checkpoint              `load_hub` (m2jax.hf.load) with an m2jax
                                tokenizer directory, or the byte tokenizer.
The optimizer starts afresh (moments at zero, step 0, its own warm-up).
The SFT run directory has a pretraining run's layout (config.json with
model, train and the chat DataConfig; tokenizer/; checkpoints/), so another
SFT, generation or the server can start from it in turn, and sft.json
names where it started.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from m2jax import hf
from m2jax import model
from m2jax.config import ConfigError, ModelConfig, config_from_dict
from m2jax.data import ByteTokenizer, DataConfig, Tokenizer, load_tokenizer
from m2jax.data import chat
from m2jax.data.chat_data import ChatData
from m2jax.data.tokenizer_files import CONFIG_FILE as TOKENIZER_FILE
from m2jax.errors import MissingPathError
from m2jax.infer import sample
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain

INIT_FILE = "sft.json"  # in the SFT workdir: where the run started


@dataclasses.dataclass(frozen=True, eq=False)
class Init:
  """Where fine-tuning starts: a model, its variables and its tokenizer."""
  model_config: ModelConfig
  variables: dict
  tokenizer: Tokenizer
  origin: dict  # {"init": dir, "step"} or {"hf_path", "tokenizer"}: sft.json


def read_run_configs(workdir: str) -> tuple[ModelConfig, TrainConfig,
                                            DataConfig]:
  """The model, train and data configs of a run directory's config.json."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise MissingPathError(f"{path} not found: is {workdir} a run directory "
                           "(experiments.pretrain or experiments.sft)?")
  with open(path, encoding="utf-8") as f:
    raw = json.load(f)
  return (config_from_dict(ModelConfig, raw["model"]),
          config_from_dict(TrainConfig, raw["train"]),
          config_from_dict(DataConfig, raw["data"]))


def load_init(run_dir: str) -> Init:
  """The newest checkpoint of a pretraining (or SFT) run directory."""
  mcfg, tcfg, _ = read_run_configs(run_dir)
  abstract = jax.eval_shape(lambda: state_lib.init_state(
      mcfg, tcfg, model.init(mcfg, jax.random.key(0))))
  checkpointer = ckpt_lib.Checkpointer(os.path.join(run_dir, "checkpoints"),
                                       keep=tcfg.keep_checkpoints)
  try:
    restored = checkpointer.restore_latest(abstract)
  finally:
    checkpointer.close()
  if restored is None:
    raise MissingPathError(f"--init {run_dir}: no checkpoint to start from")
  step, state, _, _ = restored
  tokenizer = load_tokenizer(os.path.join(run_dir, "tokenizer"))
  return Init(mcfg, state_lib.variables_of(state), tokenizer,
              {"init": os.path.abspath(run_dir), "step": int(step)})


def load_hub(path: str, tokenizer_dir: str | None = None) -> Init:
  """A hub checkpoint (m2jax.hf.load, parameters in float32) to fine-tune.

  The tokenizer is the m2jax tokenizer saved in `tokenizer_dir`, else in
  `path` itself, else the byte tokenizer. MTP modules the checkpoint lacks
  (the released M2 has none) are left out of the model.
  """
  mcfg, variables = hf.load(path, dtype=np.float32)
  present = sum(f"mtp_{k}" in variables["params"]
                for k in range(mcfg.num_mtp_modules))
  mcfg = mcfg.replace(num_mtp_modules=present)
  if tokenizer_dir is None and os.path.exists(os.path.join(path,
                                                           TOKENIZER_FILE)):
    tokenizer_dir = path
  tokenizer = (load_tokenizer(tokenizer_dir) if tokenizer_dir is not None
               else ByteTokenizer())
  return Init(mcfg, variables, tokenizer,
              {"hf_path": os.path.abspath(path),
               "tokenizer": tokenizer_dir and os.path.abspath(tokenizer_dir)})


def chat_data_config(tokenizer: Tokenizer, **fields) -> DataConfig:
  """The SFT DataConfig: `tokenizer`'s kind (and BPE size), `fields` for the
  rest (source: "stdlib" or chat JSONL; seq_len, batch_size, seed, split)."""
  if tokenizer.kind == "bpe":
    fields.setdefault("bpe_vocab_size", tokenizer.vocab_size)
  return DataConfig(tokenizer=tokenizer.kind, **fields)


def chat_sample(model_config: ModelConfig, variables, data: ChatData,
                max_new_tokens: int) -> dict | None:
  """The model's greedy answer to the first held-out prompt: {"prompt",
  "completion" (text), "message" (parsed), "reference" (the data's)}."""
  for conv in data.conversations["validation"]:
    messages = conv["messages"]
    first = next((i for i, m in enumerate(messages)
                  if m.get("role") == "assistant"), None)
    if first:  # an assistant turn with a prompt before it
      break
  else:
    return None
  prompt = messages[:first]
  ids = chat.render(prompt, data.tokenizer, tools=conv.get("tools"),
                    add_generation_prompt=True)[0]
  out = np.asarray(sample.greedy(model_config, variables, ids,
                                 max_new_tokens))
  text = data.tokenizer.decode(out[len(ids):])
  return {"prompt": chat.render_text(prompt, tools=conv.get("tools"),
                                     add_generation_prompt=True),
          "completion": text.split(chat.END_OF_TURN, 1)[0],
          "message": chat.parse_completion(text),
          "reference": chat.normalize_message(messages[first])}


def _has_checkpoints(workdir: str) -> bool:
  """Whether `workdir` holds a finished checkpoint step (orbax names them by
  step; unfinished ones carry a temporary suffix)."""
  directory = os.path.join(workdir, "checkpoints")
  return os.path.isdir(directory) and any(
      name.isdigit() for name in os.listdir(directory))


def finetune(model_config: ModelConfig, train_config: TrainConfig,
             data: ChatData, workdir: str, *, init: Init | None = None,
             resume: bool = False, stop_after: int | None = None,
             sample_tokens: int = 0, progress: bool = True,
             mesh=None) -> dict:
  """Fine-tune on `data`; returns pretrain's summary (val_loss: held-out
  assistant-token loss) plus "sample" (`chat_sample`) if `sample_tokens`.

  `init` gives the starting variables: needed unless the run resumes a
  checkpoint, which then replaces them.
  """
  if init is not None and init.tokenizer != data.tokenizer:
    raise ValueError("the chat data's tokenizer is not the init's")
  # A wrong data path or an empty split fails here, before any work.
  for split, conversations in data.conversations.items():
    if not len(conversations):  # pylint: disable=g-explicit-length-test
      raise ConfigError(f"the {split} split of {data.config.source!r} has "
                        "no conversations (see --validation_fraction)")
  fresh = not _has_checkpoints(workdir)
  if fresh and init is None:
    raise MissingPathError(
        f"{workdir} holds no checkpoint to continue: start it from "
        "--init=PRETRAIN_RUN or --hf_path=DIR, without --resume")
  primary = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if fresh and primary:  # (a run refused for existing checkpoints keeps it)
    ckpt_lib.write_json(os.path.join(workdir, INIT_FILE), init.origin)
  summary = pretrain(
      model_config, train_config, data, workdir, resume=resume,
      sample_tokens=0, stop_after=stop_after, progress=progress,
      init_variables=None if init is None else init.variables, mesh=mesh)
  if sample_tokens and summary["step"] == train_config.steps:
    variables = state_lib.variables_of(summary["state"])
    summary["sample"] = chat_sample(model_config, variables, data,
                                    sample_tokens)
    if primary and summary["sample"] is not None:
      ckpt_lib.write_json(os.path.join(workdir, "sample.json"),
                          summary["sample"])
  return summary
