# Two commands set everything up on a fresh machine:
#   make demo   create .venv (Python 3.12), install, pretrain the tiny preset on CPU
#   make test   create .venv (Python 3.12), install, run the test suite
#   make rl-demo  Forge RL on CPU: warm start, then CISPO on 1-digit addition

VENV := .venv
PY := $(VENV)/bin/python
# The first Python 3.12 found: on the PATH, or under pyenv.
PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && echo $$p && break; done)
DEMO_DIR ?= runs/demo
RL_DEMO_DIR ?= runs/rl-demo

.PHONY: venv demo rl-demo test clean

$(VENV)/.installed: setup.cfg pyproject.toml
	@test -n "$(PY312)" || { echo "Python 3.12 not found (tried python3.12 and ~/.pyenv/versions/3.12*)"; exit 1; }
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	rm -rf $(DEMO_DIR)
	$(PY) -m experiments.pretrain --preset=tiny --steps=1000 --seq_len=256 \
	  --batch_size=8 --learning_rate=3e-3 --warmup_steps=20 --eval_every=200 \
	  --checkpoint_every=200 --workdir=$(DEMO_DIR)

# Forge RL (m2jax/rl/loop.py): 60 SFT steps on generated demonstrations,
# then 700 CISPO steps of 16 prompts x 8 samples (about 8 minutes on 2 cores).
rl-demo: venv
	rm -rf $(RL_DEMO_DIR)
	$(PY) -m experiments.rl --preset=tiny --env=arithmetic \
	  --env_config='levels=1;ops=+' --algo=cispo --mode=sync \
	  --schedule=windowed --steps=700 --warm_start_steps=60 \
	  --groups_per_step=16 --group_size=8 --max_new_tokens=12 \
	  --learning_rate=1e-3 --decay_fraction=0.6 --eval_every=50 \
	  --eval_tasks=64 --workdir=$(RL_DEMO_DIR)

test: venv
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n 2 --dist worksteal tests

clean:
	rm -rf $(VENV) runs .pytest_cache
