"""Every command README.md and BUILD.md show is run, at tiny shapes, or
skipped for a stated reason (issue 21: a documented command that fails is
a bug a new user meets first).

The commands are read from the two files: each line of a shell code block
(backslash continuations joined, comments dropped), each inline code span
that starts like a command (`python -m ...`, `make ...`, `pip ...`,
`tensorboard ...`, a `.venv*/bin/...` program, a `*.sh` script), and each
Python code block. COMMANDS says, by the command's text, how it is covered:
run as a tiny-shape variant (a temporary workdir, a few steps, short rows;
the flags that shrink it come last, and absl lets the last value win) or
skipped, with the reason (a GPU, several hosts, installing packages, the
test suite itself). A command added to the docs without an entry here, or
an entry whose command left the docs, fails
test_every_documented_command_is_covered.

The commands that read a run share one pretrain run directory ({RUN}) and
run in one test, in order; the others each run in a test of their own, so
pytest's workers share them out. All share the session's persistent XLA
compilation cache (tests/conftest.py): after the first, they compile little.
"""

import ast
import collections
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from m2jax import hf, model
from m2jax.eval import runs
from m2jax.sweep import GRIDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "BUILD.md")
PY = "{PY}"  # this interpreter
# What every tiny pretrain adds: one layer, rows, evals and a sample small
# enough for a 2-core CPU, one shape for all (compiled once, then cached).
TINY = ("--override=num_layers=1", "--seq_len=32", "--batch_size=2",
        "--eval_batches=1", "--sample_tokens=4", "--log_every=1")
HF_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_tiny_fp32_sharded")

Run = collections.namedtuple("Run", "argv check status", defaults=(None, 0))
Skip = collections.namedtuple("Skip", "reason")

# What every tiny SFT run adds (its rows hold a whole conversation).
SFT_TINY = ("--seq_len=256", "--batch_size=2", "--max_conversations=24",
            "--eval_batches=1", "--sample_tokens=4", "--log_every=1")
MULTIHOST = ("the two-process run tests/test_multihost.py makes (with flags "
             "that only save time)")

GPU = "needs a GPU: "
INSTALLS = "installs packages (the environment these tests run in)"

# Documented command (its text, whitespace collapsed) -> how it is covered.
# In Run argv: {PY} this Python, {RUN} the shared run, {TMP} a temporary
# directory, {DEMO} the pretrain command of the Makefile's demo target.
COMMANDS = {
    # The shared run first: the commands below read it.
    "python -m experiments.pretrain --preset=tiny --steps=1000 "
    "--workdir=runs/tiny": Run(
        (PY, "-m", "experiments.pretrain", "--preset=tiny", "--steps=2",
         "--workdir={RUN}", *TINY), "run"),
    "python -m experiments.pretrain --workdir=runs/tiny --resume "
    "--steps=2000": Run(
        (PY, "-m", "experiments.pretrain", "--workdir={RUN}", "--resume",
         "--steps=3", *TINY), "resume"),
    "python -m experiments.evaluate --workdir=runs/tiny": Run(
        (PY, "-m", "experiments.evaluate", "--workdir={RUN}",
         "--tasks=niah_single", "--examples_per_point=1", "--val_batches=1"),
        "evaluate"),  # the default --lengths
    "python -m experiments.export --workdir=runs/tiny --out=runs/tiny_hub": Run(
        (PY, "-m", "experiments.export", "--workdir={RUN}",
         "--out={TMP}/tiny_hub"), "export"),
    "python -m experiments.export --workdir=RUN --out=DIR": Run(
        (PY, "-m", "experiments.export", "--workdir={RUN}",
         "--out={TMP}/hub_readme", "--step=2")),
    "make demo": Run(("{DEMO}", "--steps=2", "--workdir={TMP}/demo", *TINY)),
    "python -m experiments.pretrain --helpshort": Run(
        (PY, "-m", "experiments.pretrain", "--helpshort"), "help",
        status=1),  # absl's help flags exit with 1
    "python -m experiments.describe --preset=minimax_m2": Run(
        (PY, "-m", "experiments.describe", "--preset=minimax_m2"), "describe"),
    "python -m experiments.describe --preset=m2_small": Run(
        (PY, "-m", "experiments.describe", "--preset=m2_small")),
    "python -m experiments.sweep --grid=attention|mtp|experts|gating": Run(
        (PY, "-m", "experiments.sweep", "--grid=attention", "--variants=full",
         "--seeds=0", "--steps=2", "--seq_len=160", "--batch_size=2",
         "--override=num_layers=1", "--train_documents=8",
         "--eval_lengths=128",
         "--examples_per_point=1", "--sweep_dir={TMP}/sweep"), "sweep"),
    "python -m experiments.recall_check": Run(
        (PY, "-m", "experiments.recall_check", "--steps=2", "--batch_size=2",
         "--override=num_layers=1"), "recall",
        status=1),  # two steps learn no recall: the FAIL verdict exits 1
    "python -m experiments.recall_check --task=mqar --pairs=4 "
    "--hidden_size=128 --num_layers=2 --learning_rate=1e-3 --steps=2000 "
    "--train_gaps=0,8,16,24,32 --eval_gaps=0,32": Skip(
        "a CPU calibration of many minutes; its code path runs at tiny "
        "shapes in tests/test_mqar.py's recall_check smoke test"),
    "python -m experiments.sft --workdir=runs/sft --init=runs/demo": Run(
        (PY, "-m", "experiments.sft", "--workdir={TMP}/sft", "--init={RUN}",
         *SFT_TINY, "--steps=2"), "sft"),
    "python -m experiments.sft --workdir=runs/sft --resume": Run(
        (PY, "-m", "experiments.sft", "--workdir={TMP}/sft", "--resume",
         *SFT_TINY, "--steps=3"), "sft_resume"),
    "python -m experiments.sft --workdir=runs/sft --init=runs/demo "
    "--data='chats/*.jsonl'": Skip(
        "needs chat files of the user's; JSONL sources are read in "
        "tests/test_sft.py"),
    "python -m experiments.sft --workdir=runs/sft --hf_path=CKPT "
    "--tokenizer_dir=runs/demo/tokenizer": Skip(
        "needs a hub checkpoint; starting from one is "
        "tests/test_sft.py's load_hub test"),
    "export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_"
    "count=4": Skip(MULTIHOST),
    "for i in 0 1; do": Skip(MULTIHOST),
    "python -m experiments.pretrain --preset=tiny --override=num_layers=1 "
    "--mesh=fsdp=2,expert=4 --seq_len=64 --batch_size=8 --steps=4 "
    "--checkpoint_every=2 --workdir=runs/two "
    "--coordinator_address=127.0.0.1:12345 --num_processes=2 "
    "--process_id=$i &": Skip(MULTIHOST),
    "done; wait": Skip(MULTIHOST),
    # Not run here.
    "make test": Skip("the test suite itself, which holds this test"),
    "make venv": Skip(INSTALLS),
    ". .venv/bin/activate": Skip("changes the calling shell's PATH: these "
                                 "tests name their Python directly"),
    "python3.12 -m venv .venv && .venv/bin/pip install -e '.[test]'":
        Skip(INSTALLS),
    'pip install "jax[cuda13]==0.11.2"': Skip(GPU + "JAX's CUDA build"),
    "pip install tensorboard": Skip(
        "installs the viewer; the event files it reads are checked in the "
        "shared run"),
    "tensorboard --logdir runs/m2_small/tensorboard": Skip(
        "the viewer is not installed (pip install tensorboard); the event "
        "files are checked in the shared run"),
    "python3.11 -m venv .venv-hf && .venv-hf/bin/pip install -r "
    "scripts/requirements-hf.txt": Skip(
        "installs torch and transformers in an environment of its own"),
    ".venv-hf/bin/python scripts/make_hf_fixtures.py": Skip(
        "needs torch and transformers; tests/test_hf.py checks the fixtures "
        "it wrote against m2jax"),
    ".venv/bin/python -m pytest tests/test_model.py -q": Skip(
        "part of make test"),
    "python -m experiments.pretrain --preset=m2_small --seq_len=2048 "
    "--batch_size=8 --steps=5000 --workdir=runs/m2_small": Skip(
        GPU + "m2_small at 2048 tokens; its tiny-shape variant is the tiny "
        "pretrain above"),
    "export NCCL_NVLS_ENABLE=0": Skip(GPU + "an NCCL setting"),
    "python -m experiments.pretrain --preset=m2_small --mesh=expert=4 "
    "--seq_len=2048 --batch_size=32 --moe_capacity_factor=1.5 "
    "--workdir=runs/m2_small_ep4": Skip(
        GPU + "4 of them; the training loop on meshes runs on 8 fake CPU "
        "devices in tests/test_sharding.py"),
    "python -m experiments.pretrain --preset=m2_small --mesh=sequence=8 "
    "--seq_len=8192 --batch_size=24 --context_schedule=m2 "
    "--context_documents=packages --remat "
    "--workdir=runs/m2_small_192k": Skip(
        GPU + "8 of them and 196,608-token rows; loss and gradients on "
        "sequence=8 against one device run on 8 fake CPU devices in "
        "tests/test_sharding.py"),
    "export XLA_FLAGS=--xla_gpu_unsupported_enable_ragged_all_to_all_"
    "decomposer=true": Skip(GPU + "an XLA GPU flag"),
    "python -m experiments.pretrain --preset=m2_small --mesh=data=2,expert=8 "
    "--batch_size=128 --workdir=/shared/runs/m2 "
    "--coordinator_address=host0:1234 --num_processes=2 "
    "--process_id=$RANK": Skip("several hosts with 16 GPUs"),
    "python -m experiments.bench_gmm": Skip(GPU + "times the Hopper kernels"),
    "python -m experiments.bench_optimizers --preset=m2_small "
    "--override=num_layers=2 --steps=150 --batch=8 --seq_len=512 "
    "--train_override=sso_matmul_precision=BF16_BF16_F32_X3 "
    "--max_seconds=540 --out=benchmarks/results/optimizers/m2_small_l2.json":
        Skip(GPU + "m2_small, four optimizers, two seeds; its CPU run is "
             "tests/test_bench_optimizers.py"),
    "python -m experiments.bench_gnmr "
    "--out=benchmarks/results/gnmr_stress_cpu.json": Skip(
        "a benchmark (minutes of CPU training, five scenarios twice); "
        "tests/test_gnmr.py runs the stress harness at a short length"),
    "python -m experiments.bench_train --preset=m2_small": Skip(
        GPU + "m2_small training throughput"),
    "python -m experiments.bench_train --profile_dir=DIR --dense_baseline": Skip(
        GPU + "profiles m2_small's step; tests/test_train_profile.py checks "
        "the categories on a real CPU trace"),
    "python -m experiments.bench_long_rows": Skip(
        GPU + "rows of 32K-131K tokens of m2_small; tests/test_long_rows.py "
        "checks the step holds no [T, T] array"),
    "python -m experiments.bench_checkpoint": Skip(
        GPU + "times 15 GiB m2_small checkpoints; tests/test_checkpoint.py "
        "checks the asynchronous save"),
    "python -m experiments.bench_prefix_tree": Skip(
        GPU + "times the Hopper tree-attention kernels"),
    "python -m experiments.bench_scaling": Skip(GPU + "several of them"),
    "python -m experiments.bench_all_to_all": Skip(GPU + "several of them"),
    "python -m experiments.bench_decode": Skip(
        GPU + "times the decode kernels and the engine; its CPU dry run "
        "is in its docstring"),
    "python -m experiments.bench_serve": Skip(
        GPU + "64 clients against m2_small; its load check runs in "
        "tests/test_serve.py"),
    "benchmarks/run_h100.sh train|gmm|pretrain|gpu_tests|prefix_attention|"
    "prefix_model|prefix_agent128|decode_kernel|checkpoint": Skip(
        GPU + "runs the benchmarks on a device machine"),
    "bash benchmarks/run_ablations_gpu.sh mtp experts attention_mqar "
    "attention_lm gating": Skip(
        GPU + "three seeds of every grid; tests/test_sweep.py runs grids, "
        "--parallel and --equal_compute at tiny shapes"),
    "python -m experiments.agent_learning": Skip(
        GPU + "six RL runs of hundreds of steps (hours each on 2 cores); "
        "tests/test_rl_agent.py and tests/test_rl_blackbox.py run both "
        "agents' RL loops at tiny shapes, tests/test_sweep.py its report"),
    "benchmarks/run_agents_gpu.sh learning": Skip(
        GPU + "runs experiments.agent_learning on a device machine"),
    "benchmarks/run_agents_gpu.sh learning_cpu": Skip(
        GPU + "runs experiments.agent_learning on a device machine's CPU "
        "cores (its warm start on a GPU)"),
    "benchmarks/run_sweep_vmap_gpu.sh step|sweep": Skip(
        GPU + "times N models in one vmapped program; tests/test_multi.py "
        "and the sweep test's --parallel arm run it on CPU"),
    "python -m experiments.bench_router --preset=m2_small --steps=2000 "
    "--batch=8 --seq_len=512 --max_seconds=400 "
    "--out=benchmarks/results/router/m2_small_h100.json": Skip(
        GPU + "m2_small's routers over 2,000 steps; tests/test_bench_router.py "
        "runs it at tiny size"),
    "make rl-demo": Skip("eight minutes of RL on 2 cores: tests/test_rl_loop.py "
                         "runs the loop at tiny shapes"),
    "python -m experiments.rl --preset=tiny --env=sorting --algo=dapo "
    "--mode=async --schedule=windowed --latency_scale=0.01 --steps=200 "
    "--workdir=runs/rl": Skip("tests/test_rl_loop.py runs async mode and the "
                              "command line at tiny shapes"),
    "python -m experiments.rl --workdir=runs/rl --resume": Skip(
        "tests/test_rl_loop.py resumes runs and checks them bit for bit"),
    "python -m experiments.bench_schedule --env=arithmetic "
    "--out=benchmarks/results/schedule_arithmetic.json": Skip(
        "a benchmark (15 s of simulation); tests/test_rl_scheduler.py runs "
        "the simulator"),
    "python -m experiments.bench_rl --preset=m2_small "
    "--out=benchmarks/results/rl_h100.json": Skip(
        GPU + "runs the benchmarks on a device machine"),
    "python -m experiments.serve --workdir=runs/demo": Skip(
        "a server that runs until stopped: tests/test_serve.py drives one"),
    "python -m experiments.serve --preset=tiny --record "
    "--pool=runs/pool.sqlite": Skip(
        "a server that runs until stopped: tests/test_gateway.py runs this "
        "command and kills it"),
    "curl -s http://127.0.0.1:8000/v1/chat/completions -H \"Content-Type: "
    "application/json\" -d '{\"model\": \"demo\", \"messages\": "
    "[{\"role\": \"user\", \"content\": \"def fib(n):\"}], "
    "\"max_tokens\": 32}'": Skip("needs the server above running"),
    "python -m experiments.bench_serve --workdir=runs/m2_small "
    "--out=benchmarks/results/serve_h100.json": Skip(
        GPU + "64 clients against a trained m2_small; its load check runs "
        "in tests/test_serve.py"),
}

# Python code blocks, by their first line -> ({text: replacement}, checks
# run after the block, in its namespace).
PYTHON_BLOCKS = {
    # The comment on load_E: [layers, experts], each row sums to tokens x
    # top_k, and it feeds the bias update.
    "import jax": ({}, """
import numpy as np
assert out.routing.load_E.shape == (cfg.num_layers, cfg.num_experts)
np.testing.assert_allclose(np.asarray(out.routing.load_E).sum(axis=1),
                           tokens.size * cfg.num_experts_per_tok)
assert jax.tree.structure(bias) == jax.tree.structure(
    variables["expert_bias"])
"""),
    "import m2jax.hf": ({"/path/to/MiniMax-M2": HF_FIXTURE},
                        "assert cfg.param_dtype == cfg.compute_dtype\n"),
}

_COMMAND_SPAN = re.compile(
    r"^(python\S* -m |python\S* \S+\.py|make |pip |tensorboard |"
    r"\.venv\S*/bin/|\S+\.sh\b)")


def _normalize(text: str) -> str:
  return " ".join(text.replace("\\\n", " ").split())


def documented():
  """(shell commands, python blocks) of README.md and BUILD.md, in order."""
  commands, blocks = [], []
  for name in DOCS:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      text = f.read()
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
      if lang == "python":
        blocks.append(body)
        continue
      if lang == "text":  # a format shown, not a command
        continue
      for line in body.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if line:
          commands.append(_normalize(line))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for span in re.findall(r"`([^`]+)`", prose):
      span = _normalize(span)
      if _COMMAND_SPAN.match(span):
        commands.append(span)
  return list(dict.fromkeys(commands)), blocks


def test_every_documented_command_is_covered():
  commands, blocks = documented()
  missing = [c for c in commands if c not in COMMANDS]
  stale = [c for c in COMMANDS if c not in commands]
  assert not missing, f"documented but not in COMMANDS: {missing}"
  assert not stale, f"in COMMANDS but no longer documented: {stale}"
  firsts = [b.splitlines()[0] for b in blocks]
  assert sorted(firsts) == sorted(PYTHON_BLOCKS), firsts
  # The README's one sweep line names every grid there is.
  assert {"attention", "mtp", "experts", "gating"} == set(GRIDS)


def test_script_docstrings_keep_their_lines():
  # An experiment script's docstring is its --help text; in a plain string
  # a backslash continuation of a usage example joins it with the next line.
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py"))):
    with open(path, encoding="utf-8") as f:
      source = f.read()
    tree = ast.parse(source)
    if not (tree.body and isinstance(tree.body[0], ast.Expr)):
      continue
    written = ast.get_source_segment(source, tree.body[0])
    assert tree.body[0].value.value.count("\n") == written.count("\n"), (
        f"{path}: make the docstring raw (r\"\"\"...)")


def _demo_command() -> list[str]:
  """The pretrain command of the Makefile's demo target, as argv."""
  with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
    recipe = f.read().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
  line = next(l for l in recipe.replace("\\\n", " ").splitlines()
              if "-m experiments.pretrain" in l)
  argv = shlex.split(line.replace("$(PY)", sys.executable))
  return [a for a in argv if "$(DEMO_DIR)" not in a]


def _python_block_programs() -> dict[str, str]:
  """{first line: the block with its replacements, then its checks}."""
  _, blocks = documented()
  programs = {}
  for body in blocks:
    first = body.splitlines()[0]
    replacements, checks = PYTHON_BLOCKS[first]
    for old, new in replacements.items():
      body = body.replace(old, new)
    programs[first] = body + checks
  return programs


def _check(kind, proc, tmp):
  """Command-specific checks of what a run left behind."""
  run = os.path.join(tmp, "run")
  if kind == "run":
    assert os.listdir(os.path.join(run, "tensorboard"))  # event files
    assert runs.checkpoint_steps(run) == [2]
  elif kind == "resume":
    assert runs.checkpoint_steps(run)[-1] == 3
  elif kind == "evaluate":
    with open(os.path.join(run, "eval.json"), encoding="utf-8") as f:
      result = json.load(f)
    assert result["step"] == 3 and np.isfinite(result["val_loss"])
    assert sorted(result["tasks"]["niah_single"]) == ["128", "256", "512"]
  elif kind == "export":
    cfg, variables = hf.load(os.path.join(tmp, "tiny_hub"))
    assert cfg == runs.load_configs(run)[0]
    # The variables fit the model (traced, not run: the shape is what is
    # checked, and an eager forward is seconds of op-by-op compiles).
    logits = jax.eval_shape(
        lambda v: model.logits(cfg, v, np.zeros((1, 4), np.int32)), variables)
    assert logits.shape == (1, 4, cfg.vocab_size)
  elif kind == "help":
    # The usage examples keep their lines (a docstring's backslash
    # continuations once joined them into one).
    lines = proc.stdout.splitlines()
    example = ("  python -m experiments.pretrain --preset=m2_small "
               "--seq_len=8192 \\")
    assert example in lines, proc.stdout[:2000]
    assert any(l.startswith("  --context_schedule:") for l in lines)
  elif kind == "describe":
    assert "228689764864" in proc.stdout.replace(",", "")
  elif kind == "sweep":
    assert os.path.exists(os.path.join(tmp, "sweep", "results.json"))
  elif kind == "recall":
    assert "recall accuracy" in proc.stdout and "FAIL" in proc.stdout
  elif kind in ("sft", "sft_resume"):
    sft_run = os.path.join(tmp, "sft")
    assert runs.checkpoint_steps(sft_run)[-1] == (2 if kind == "sft" else 3)
    assert os.path.exists(os.path.join(sft_run, "sft.json"))


def _env() -> dict:
  # The session's compilation cache (tests/conftest.py) is shared by every
  # command: one tiny shape for all, compiled once.
  return dict(os.environ, JAX_PLATFORMS="cpu",
              # Compiling dominates on a CPU; the arrays are tiny.
              XLA_FLAGS="--xla_backend_optimization_level=0 "
              "--xla_llvm_disable_expensive_passes=true")


def _run(command: str, how: Run, tmp_path) -> str | None:
  """Runs one documented command's tiny variant: None, or what failed."""
  subs = {"{PY}": sys.executable, "{RUN}": str(tmp_path / "run"),
          "{TMP}": str(tmp_path)}
  argv = []
  for arg in how.argv:
    if arg == "{DEMO}":
      argv += _demo_command()
      continue
    for key, value in subs.items():
      arg = arg.replace(key, value)
    argv.append(arg)
  proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=300, check=False)
  try:
    assert proc.returncode == how.status, f"exit status {proc.returncode}"
    assert "Traceback" not in proc.stderr
    _check(how.check, proc, str(tmp_path))
  except AssertionError as e:
    return (f"{command}\n  ran {shlex.join(argv)}\n  {e}\n"
            f"  stderr: {proc.stderr[-1500:]}")
  return None


def _uses_the_run(how) -> bool:
  """Whether the command reads the shared run (or what a command that read
  it wrote: the SFT resume continues the SFT run)."""
  return isinstance(how, Run) and (any("{RUN}" in a for a in how.argv)
                                   or how.check == "sft_resume")


def test_documented_commands_on_one_run_directory(tmp_path):
  """The commands that read the shared run, in the docs' order after the
  pretrain command that makes it."""
  failures = []
  for command, how in COMMANDS.items():
    if _uses_the_run(how):
      failure = _run(command, how, tmp_path)
      if failure:
        failures.append(failure)
        if how.check == "run":
          break  # the others read this run
  assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("command", [
    c for c, how in COMMANDS.items()
    if isinstance(how, Run) and not _uses_the_run(how)])
def test_documented_command_runs(command, tmp_path):
  failure = _run(command, COMMANDS[command], tmp_path)
  assert failure is None, failure


@pytest.mark.parametrize("first", sorted(PYTHON_BLOCKS))
def test_documented_python_block_runs(first):
  program = _python_block_programs()[first]
  proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT,
                        env=_env(), capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-1500:]
