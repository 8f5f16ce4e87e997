"""The Forge RL loop (m2jax.rl.loop): sync and async runs, exact resume, a
crash between rollouts and training, the engine's weight sync, and the
command line's refusals.

Runs are tiny (random init, no warm start unless a test needs one, groups
of 2 samples, 4-token actions) so that they cost a few compilations; the
pool's atomicity, the scheduler's rule and each loss against numpy have
their own files (test_rl_pool.py, test_rl_scheduler.py,
test_rl_objectives.py)."""

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.data import ByteTokenizer, chat
from m2jax.infer.engine import Engine, EngineConfig
from m2jax.infer.sampling import SamplingParams
from m2jax.rl import loop
from m2jax.rl import pool as pool_lib
from m2jax.rl import rollout as rollout_lib
from m2jax.rl import scheduler as sched_lib
from m2jax.rl import step as rl_step
from m2jax.rl import trainer as trainer_lib
from m2jax.settings import Settings
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import sft
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig

# One layer (and the MTP module): what these tests check is the loop's, not
# the depth's (the engine and the step have their own tests at two layers),
# and every program compiles in about two thirds of the time.
CFG = config_lib.TINY.replace(num_layers=1, settings=Settings(attention="xla"))
TRAIN = TrainConfig(steps=3, learning_rate=1e-3, warmup_steps=0,
                    decay_fraction=0.0, weight_decay=0.0, mtp_depth=1,
                    mtp_weight=0.1, mtp_weight_final=0.1)
ENGINE = EngineConfig(max_batch=8, num_pages=64, prefill_chunk=64)
ROLLOUT = rollout_lib.RolloutConfig(group_size=2, max_new_tokens=4)
TRAINER = trainer_lib.TrainerConfig(row_len=64, rows_per_micro_batch=2)
RL = rl_step.RLConfig(mtp_depth=1)


def _run_config(**kw) -> loop.RLRunConfig:
  fields = dict(env="arithmetic", env_fields=(("levels", (1,)),
                                              ("ops", ("+",))),
                steps=3, groups_per_step=2, warm_start_steps=0,
                eval_tasks=0, checkpoint_every=1)
  fields.update(kw)
  return loop.RLRunConfig(**fields)


def _run(workdir, run_config, **kw):
  kw.setdefault("rl_config", RL)
  return loop.run(CFG, TRAIN, run_config, str(workdir),
                  rollout_config=ROLLOUT, trainer_config=TRAINER,
                  engine_config=ENGINE, progress=False, **kw)


def _params(workdir):
  """The newest checkpoint's parameters, flattened."""
  from m2jax.train import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  from m2jax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=5,
                               read_only=True)
  state = state_lib.create_state(CFG, TRAIN)
  step = ckpt.steps()[-1]
  restored, _, meta = ckpt.restore(step, ckpt_lib.abstract(state))
  ckpt.close()
  return step, meta["version"], jax.tree.leaves(restored.params)


def _batches(workdir, steps):
  with pool_lib.Pool(os.path.join(workdir, loop.POOL_FILE)) as pool:
    return [[(t.trajectory_id, t.steps[0].action.tolist())
             for t in pool.trained_in(s)] for s in steps]


def _crash(monkeypatch, where: str):
  """Make the run die at step 2: before training on its verified groups,
  or after training (and marking them trained in the pool) but before its
  checkpoint. Returns a function that undoes it."""
  if where == "before training":
    target, name = trainer_lib.Trainer, "train"
    original = target.train

    def patched(self, trajectories):
      if int(self.state.step) == 1:
        raise RuntimeError("killed")
      return original(self, trajectories)
  else:
    target, name = loop._Run, "_checkpoint"  # pylint: disable=protected-access
    original = target._checkpoint  # pylint: disable=protected-access

    def patched(self):
      if self.step == 2:
        raise RuntimeError("killed")
      return original(self)
  monkeypatch.setattr(target, name, patched)
  return lambda: monkeypatch.setattr(target, name, original)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
  """(directory, summary) of the uninterrupted 3-step sync run on one
  device: the reference of the resume test and of the mesh check."""
  whole = tmp_path_factory.mktemp("rl_loop") / "whole"
  return whole, _run(whole, _run_config())


def test_resume_after_a_stop_or_a_crash_equals_the_uninterrupted_run(
    tmp_path, monkeypatch, whole_run):
  """A sync run stopped after step 1, or killed at step 2 (before training
  on the groups it verified, or after training before its checkpoint), and
  resumed, trains exactly the batches the uninterrupted run trains (each
  trajectory once, none generated twice) to the same parameters, bit for
  bit; metrics.jsonl reads as one run."""
  whole, summary = whole_run
  assert summary["step"] == 3
  # 3 steps x 2 groups x 2 samples, each trained once.
  assert summary["pool"] == {"finished": 12, "trained": 12, "discarded": 0,
                             "untrained": 0}
  expected = _params(whole)
  assert expected[:2] == (3, 3)
  for case in ("stopped", "before training", "before checkpoint"):
    workdir = tmp_path / case.replace(" ", "_")
    if case == "stopped":
      _run(workdir, _run_config(), stop_after=1)
    else:
      undo = _crash(monkeypatch, case)
      with pytest.raises(RuntimeError, match="killed"):
        _run(workdir, _run_config())
      undo()
      with pool_lib.Pool(workdir / loop.POOL_FILE) as pool:
        # Step 2's groups are verified (and trained, in the second case).
        assert pool.counts()["finished"] == 8, case
    assert _params(workdir)[:2] == (1, 1), case
    resumed = _run(workdir, _run_config(), resume=True)
    assert resumed["pool"] == summary["pool"], case
    step, version, params = _params(workdir)
    assert (step, version) == (3, 3), case
    for a, b in zip(expected[2], params):
      np.testing.assert_array_equal(a, b, err_msg=case)
    assert _batches(whole, [1, 2, 3]) == _batches(workdir, [1, 2, 3]), case
    lines = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
    assert [l["step"] for l in lines] == [1, 2, 3], case


def test_async_run_overlaps_and_keeps_the_lag_bound(tmp_path):
  """Async mode with a slow environment: the trainer trains on groups of
  weights at most max_lag versions old, waits (idle > 0), and every group
  it took is in the pool as trained; stale ones are discarded, not lost."""
  run_config = _run_config(mode="async", steps=3, max_in_flight=4)
  schedule = sched_lib.ScheduleConfig(max_lag=1)
  rollout = ROLLOUT.__class__(group_size=2, max_new_tokens=4,
                              latency_scale=0.01)
  summary = loop.run(CFG, TRAIN, run_config, str(tmp_path), rl_config=RL,
                     rollout_config=rollout, trainer_config=TRAINER,
                     engine_config=ENGINE, schedule_config=schedule,
                     progress=False)
  assert summary["step"] == 3
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert max(l["policy_lag_max"] for l in lines) <= 1
  assert all(0 <= l["trainer_idle_fraction"] <= 1 for l in lines)
  assert any(l["trainer_idle_fraction"] > 0 for l in lines)
  counts = summary["pool"]
  assert counts["trained"] == 12
  assert counts["finished"] == (counts["trained"] + counts["discarded"]
                                + counts["untrained"])


def test_update_variables_syncs_weights_and_empties_the_prefix_cache():
  """After update_variables the engine samples from the new weights (equal
  to a fresh engine's greedy output) and reuses no page the old weights
  computed."""
  old = model.init(CFG, jax.random.key(0))
  new = model.init(CFG, jax.random.key(1))
  prompt = list(range(40, 40 + 37))  # two full pages of 16, cacheable
  greedy = SamplingParams(temperature=0, max_tokens=6)
  engine = Engine(CFG, old, ENGINE)
  engine.generate([prompt], greedy)
  engine.update_variables(new)
  engine.stats.clear()
  out = engine.generate([prompt], greedy)[0][0]
  assert engine.stats["prefix_hit_tokens"] == 0
  fresh = Engine(CFG, new, ENGINE).generate([prompt], greedy)[0][0]
  assert out.tokens == fresh.tokens
  np.testing.assert_allclose(out.logprobs, fresh.logprobs, atol=1e-5)
  # The same prompt again now hits the cache of the new weights.
  engine.generate([prompt], greedy)
  assert engine.stats["prefix_hit_tokens"] == 32


def test_stop_string_kept_in_the_output_when_asked():
  """include_stop_str_in_output keeps the end-of-turn tokens and their
  log-probs (RL trains the policy to stop); the default cuts them."""
  tok = ByteTokenizer()
  variables = model.init(CFG, jax.random.key(0))
  engine = Engine(CFG, variables, ENGINE, tokenizer=tok)
  prompt = [tok.bos_id] + list(tok.encode("1+1="))
  plain = engine.generate([prompt], SamplingParams(
      temperature=0, max_tokens=24))[0][0]
  # A stop string the greedy output contains: its 3rd-5th generated bytes.
  text = tok.decode(plain.tokens)
  stop = text[2:5]
  assert stop and stop in text
  kept = engine.generate([prompt], SamplingParams(
      temperature=0, max_tokens=24, stop=(stop,),
      include_stop_str_in_output=True))[0][0]
  cut = engine.generate([prompt], SamplingParams(
      temperature=0, max_tokens=24, stop=(stop,)))[0][0]
  assert tok.decode(kept.tokens) == text[:text.index(stop) + len(stop)]
  assert tok.decode(cut.tokens) == text[:text.index(stop)]
  assert len(kept.logprobs) == len(kept.tokens)
  assert kept.finish_reason == cut.finish_reason == "stop"


def test_rollout_groups_are_chat_prompts_with_end_of_turn_actions(tmp_path):
  """A rollout group: the chat-rendered prompt as the state, the sampled
  action with its log-probs, queue positions seq * G + i, verified."""
  tok = ByteTokenizer()
  engine = Engine(CFG, model.init(CFG, jax.random.key(0)), ENGINE,
                  tokenizer=tok)
  env = loop.envs.make("arithmetic", levels=(1,), ops=("+",))
  pool = pool_lib.Pool(tmp_path / "pool.sqlite")
  ro = rollout_lib.Rollout(engine, env, tok, pool, ROLLOUT, seed=3)
  gid = ro.submit(5, version=7)
  done = []
  while ro.in_flight:
    done += ro.poll()
  assert done == [gid] == ["g00000005"]
  trajs = pool.untrained()
  task = env.sample(rollout_lib.task_rng(3, 5))
  assert [t.queue_seq for t in trajs] == [10, 11]
  for t in trajs:
    (step,) = t.steps
    assert step.state.tolist() == chat.render(
        [{"role": "user", "content": task.prompt}], tok,
        add_generation_prompt=True)[0].tolist()
    assert len(step.action) == len(step.logprobs) <= 4
    assert step.policy_version == 7 and t.task_id == task.task_id
    assert t.reward == env.verify(
        task, rollout_lib.completion_text(step.action, tok)).reward


@pytest.mark.parametrize("args, message", [
    (["--env_config=digits=3"], "--env_config: 'digits=3' is not FIELD=VALUE"),
    (["--env_config=levels=x"], "does not read as Arithmetic.levels"),
    (["--resume"], "holds no RL run"),
])
def test_cli_refuses_bad_flags_in_one_line(tmp_path, args, message):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.rl", f"--workdir={tmp_path}",
       *args], capture_output=True, text=True, timeout=120,
      cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.returncode != 0
  lines = [l for l in out.stderr.splitlines() if l.strip()]
  assert message in lines[-1], out.stderr[-2000:]
  assert not os.path.exists(tmp_path / loop.POOL_FILE)


def test_resume_may_lengthen_the_run_and_change_its_cadence(tmp_path):
  """--steps, --max_rollouts and the cadence flags may change on resume
  (the CLI's RESUMABLE_RUN_FIELDS; the optimizer schedule follows the
  length); another field is refused naming it. A rollout budget ends the
  run at the step that spends it, before `steps`."""
  _run(tmp_path, _run_config(steps=1))
  # 2 groups x 2 samples a step: the budget of 8 is spent at step 2 of 5,
  # which is checkpointed as the run's last.
  longer = _run_config(steps=5, max_rollouts=8, eval_every=5,
                       checkpoint_every=3)
  summary = loop.run(CFG, TRAIN.replace(steps=5), longer, str(tmp_path),
                     rl_config=RL, rollout_config=ROLLOUT,
                     trainer_config=TRAINER, engine_config=ENGINE,
                     resume=True, progress=False)
  assert summary["step"] == 2
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [l["rollouts"] for l in lines] == [4, 8]
  assert _params(tmp_path)[:2] == (2, 2)
  with pytest.raises(config_lib.ConfigError, match="groups_per_step"):
    _run(tmp_path, _run_config(steps=3, groups_per_step=3), resume=True)


def test_frozen_references_survive_a_resume(tmp_path):
  """The KL's reference policy and RLConfig.mtp_reference's MTP modules are
  the run's start (its warm start), also after a resume: a run stopped
  after step 1 and resumed trains to the uninterrupted run's parameters,
  bit for bit, with the same reference metrics. Before any update the
  reference MTP modules are the co-trained ones (step 1: equal metrics);
  co-training then moves the live ones away."""
  rl = rl_step.RLConfig(mtp_depth=1, kl_coef=0.5, mtp_reference=True)
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  _run(whole, _run_config(), rl_config=rl)
  _run(parts, _run_config(), rl_config=rl, stop_after=1)
  _run(parts, _run_config(), rl_config=rl, resume=True)
  for a, b in zip(_params(whole)[2], _params(parts)[2]):
    np.testing.assert_array_equal(a, b)
  lines = {name: [json.loads(l) for l in open(d / "metrics.jsonl")]
           for name, d in (("whole", whole), ("parts", parts))}
  for key in ("mtp/ref_kl", "mtp/ref_accept_prob", "policy/kl"):
    assert ([l[key] for l in lines["whole"]]
            == [l[key] for l in lines["parts"]]), key
  first, last = lines["whole"][0], lines["whole"][-1]
  # The step's forward (under its gradient) and the reference's sum in
  # another order: equal to float32 rounding.
  assert first["mtp/ref_kl"] == pytest.approx(first["mtp/kl"], rel=1e-5)
  assert first["mtp/ref_accept_prob"] == pytest.approx(
      first["mtp/accept_prob"], rel=1e-5)
  assert abs(last["mtp/ref_kl"] - last["mtp/kl"]) > 1e-3 * last["mtp/kl"]


def _init_run(workdir: str, model_config, seed: int | None) -> None:
  """A run directory as experiments.pretrain leaves it (config.json,
  tokenizer/, a checkpoint at step 4) of a model initialised from `seed`
  (None: zeros of the model's shapes, for a run only its config is read
  of; model.init would compile for that config alone)."""
  meta = {"model": config_lib.config_to_dict(model_config),
          "train": config_lib.config_to_dict(TRAIN),
          "data": {}}
  os.makedirs(workdir)
  ByteTokenizer().save(os.path.join(workdir, "tokenizer"))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(meta, f)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=1)
  if seed is None:
    variables = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                             jax.eval_shape(functools.partial(
                                 model.init, model_config, jax.random.key(0))))
  else:
    variables = model.init(model_config, jax.random.key(seed))
  checkpointer.save(4, state_lib.init_state(model_config, TRAIN, variables),
                    {}, meta)
  checkpointer.close()


def test_a_resumed_run_reloads_the_init_it_started_from(tmp_path):
  """A run started from --init records that directory in config.json, and
  a resume reloads it (the weights a run killed before its first
  checkpoint starts over from, and the tokenizer); a moved directory or
  another model's is refused in one line."""
  init_dir = str(tmp_path / "init")
  _init_run(init_dir, CFG, seed=7)
  init = sft.load_init(init_dir)
  workdir = str(tmp_path / "rl")
  _run(workdir, _run_config(steps=1), init=init)
  saved = json.load(open(os.path.join(workdir, loop.CONFIG_FILE)))
  assert saved[loop.INIT_KEY] == {"init": init_dir, "step": 4}
  again = loop.resumed_init(workdir, CFG)
  assert again.origin == init.origin
  for a, b in zip(jax.tree.leaves(again.variables),
                  jax.tree.leaves(init.variables)):
    np.testing.assert_array_equal(a, b)
  other = str(tmp_path / "other")
  _init_run(other, CFG.replace(hidden_size=2 * CFG.hidden_size), seed=None)
  with pytest.raises(config_lib.ConfigError, match="not the one"):
    loop.resumed_init(workdir, CFG, init_dir=other)
  os.rename(init_dir, str(tmp_path / "moved"))
  with pytest.raises(config_lib.ConfigError, match="not a directory any"):
    loop.resumed_init(workdir, CFG)
  fresh = str(tmp_path / "fresh")
  _run(fresh, _run_config(steps=1))
  assert loop.resumed_init(fresh, CFG) is None


def test_loop_on_a_mesh_equals_one_device(whole_run):
  """The RL loop on the mesh data=2,expert=2 (4 fake CPU devices, the
  trainer's state and the engine sharded as pretraining and serving shard
  them) trains the same batches to the same parameters as one device
  (tests/rl_mesh_check.py, in its own process, against the one-device run
  of whole_run)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "tests", "rl_mesh_check.py"),
       str(whole_run[0])],
      capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "data=2,expert=2: same batches" in proc.stdout, proc.stdout
