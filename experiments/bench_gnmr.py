"""GNMR stress benchmark (issue 19): a small model trained clean and with
injected gradient spikes, infs and NaNs and fake-fp8 activations, GNMR on
and off (benchmarks.gnmr_stress; CPU, a few minutes at the defaults).

Prints, per run, the final validation loss against the clean run's, the
clean run's false-trigger rate, what GNMR did with every fault and whether
the budget held; writes it all to --out.

  python -m experiments.bench_gnmr --out=benchmarks/results/gnmr_stress_cpu.json
"""


from absl import flags

from benchmarks import gnmr_stress
from benchmarks import timing
from experiments import cli
from m2jax import config as config_lib
from m2jax.config import config_to_dict
from m2jax.data import DataConfig
from m2jax.train import checkpoint
from m2jax.train.config import OPTIMIZERS, GNMRConfig, TrainConfig

_OUT = flags.DEFINE_string("out", "benchmarks/results/gnmr_stress_cpu.json",
                           "JSON results")
_PRESET = flags.DEFINE_string("preset", "tiny", "model preset")
_OVERRIDE = flags.DEFINE_multi_string("override", [],
                                      "model FIELD=VALUE overrides")
_GNMR = flags.DEFINE_multi_string(
    "gnmr", [], "GNMRConfig FIELD=VALUE overrides (m2jax.train.gnmr)")
_STEPS = flags.DEFINE_integer("steps", 300, "train steps per run",
                              lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "tokens per row",
                                lower_bound=2)
_BATCH = flags.DEFINE_integer("batch_size", 8, "rows per batch",
                              lower_bound=1)
_MAX_DOCS = flags.DEFINE_integer(
    "max_documents", 400, "stdlib documents per split (startup time)",
    lower_bound=1)
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 8,
                                     "validation batches of the final loss",
                                     lower_bound=1)
_OPTIMIZER = flags.DEFINE_enum("optimizer", "adamw", list(OPTIMIZERS),
                               "optimizer GNMR is chained before")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "peak learning rate")
_WARMUP = flags.DEFINE_integer("warmup_steps", 20, "learning-rate warm-up",
                               lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "init and data seed")
_FACTOR = flags.DEFINE_float("factor", 1000.0, "gradient spike factor")
_SCENARIOS = flags.DEFINE_list(
    "scenarios", ["clean", "faults", "burst", "fp8", "fp8_faults"],
    "scenarios to run, each with GNMR off and on (clean always runs)")


def _print(result):
  print(f"{result['units']} units")
  print(f"{'run':<16}{'gnmr':>5}{'val loss':>10}{'vs clean':>10}"
        f"{'triggers':>10}{'rate':>9}{'max rec':>8}  faults")
  for r in result["runs"]:
    faults = ", ".join(f"{f['kind']}@{f['step']}:{f.get('action', '-')}"
                       for f in r.get("faults", [])[:6])
    if "burst" in r:
      faults = (f"{r['burst']['handled']}/{r['burst']['spiked']} handled, "
                f"most severe chosen: {r['burst']['most_severe_chosen']}")
    print(f"{r['scenario']:<16}{'on' if r['gnmr'] else 'off':>5}"
          f"{r['val_loss']:>10.4f}{r['val_loss_rel_to_clean']:>+10.2%}"
          f"{r.get('triggered', float('nan')):>10.0f}"
          f"{r.get('trigger_rate', float('nan')):>9.3%}"
          f"{r.get('max_recovering', float('nan')):>8.0f}  {faults}")


def main(argv):
  del argv
  mcfg = config_lib.apply_overrides(config_lib.get_preset(_PRESET.value),
                                    _OVERRIDE.value)
  gcfg = config_lib.apply_overrides(GNMRConfig(), _GNMR.value)
  dcfg = DataConfig(seq_len=_SEQ_LEN.value, batch_size=_BATCH.value,
                    max_documents=_MAX_DOCS.value, seed=_SEED.value,
                    validation_fraction=0.1)
  off = TrainConfig(steps=_STEPS.value, seed=_SEED.value,
                    optimizer=_OPTIMIZER.value,
                    learning_rate=_LR.value, warmup_steps=_WARMUP.value)
  harness = gnmr_stress.Harness(mcfg, dcfg, steps=_STEPS.value,
                                eval_batches=_EVAL_BATCHES.value)
  scenarios = {s.name: s for s in gnmr_stress.default_scenarios(
      harness.layout, _STEPS.value, factor=_FACTOR.value,
      max_recovering=gcfg.max_recovering)}
  unknown = set(_SCENARIOS.value) - set(scenarios)
  if unknown:
    raise config_lib.ConfigError(
        f"--scenarios: unknown {sorted(unknown)}; known {sorted(scenarios)}")
  runs = []
  for name in dict.fromkeys(["clean", *_SCENARIOS.value]):
    for tcfg in (off, off.replace(gnmr=gcfg)):
      runs.append(harness.run(tcfg, scenarios[name]))
      print(f"{name} gnmr={'on' if tcfg.gnmr else 'off'}: "
            f"{runs[-1]['seconds']:.1f} s", flush=True)
  result = gnmr_stress.report(runs, harness.layout, gcfg)
  _print(result)
  out = dict(timing.run_header(), model=config_to_dict(mcfg),
             train=config_to_dict(off), gnmr=config_to_dict(gcfg),
             data=config_to_dict(dcfg), **result)
  checkpoint.write_json(_OUT.value, out)
  print("wrote", _OUT.value)


if __name__ == "__main__":
  cli.run(main)
