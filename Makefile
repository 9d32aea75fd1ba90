# hybrid_rl: `make train` and `make test` do all set-up on a fresh clone.
PY      ?= python3
VENV    ?= .venv
# an existing interpreter (absolute path) skips the venv, e.g. on a prepared GPU box: make train VPY=$$(command -v python3)
VPY     ?= $(VENV)/bin/python
RECIPE  ?= cpu_successor
ARGS    ?=
TEST_WORKERS ?= 2
# ranks: all visible GPUs, or one process on CPU
GPUS    ?= $(shell nvidia-smi -L 2>/dev/null | wc -l | awk '{print ($$1>0)?$$1:1}')
# CPU-only machines get the CPU torch build (no multi-GB CUDA download)
TORCH_SPEC ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: install train plan test test-slow test-learning test-all test-gpu bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -c constraints.txt -e ".[test]"

install: $(VPY)

# checks the config and what the recipe needs in one process, then launches $(GPUS) ranks (torchrun inside);
# the same as .venv/bin/hybrid-rl train --nproc N recipes/X.yaml key=value ...
train: $(VPY)
	$(VPY) -m hybrid_rl train --nproc $(GPUS) recipes/$(RECIPE).yaml $(ARGS)

# the predicted peak memory per GPU of each phase of the recipe and whether it fits; exits 1 naming the one setting to
# change when it does not (ARGS: overrides and --gpus N, --gpu H100 or --gpu-memory-gb G; default: the visible GPUs)
plan: $(VPY)
	$(VPY) -m hybrid_rl plan recipes/$(RECIPE).yaml $(ARGS)

# the suite without the slow, learning and GPU tests (setup.cfg's default), on two pytest-xdist workers
test: $(VPY)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# training runs in subprocesses, multi-rank (torchrun) and real-model tests
test-slow: $(VPY)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) -m "slow and not gpu and not learning" $(PYTEST_ARGS)

# the CPU learning curves: the default recipe (sync, 250 steps, with validation), overlap mode, GAE in sync and
# overlap mode, partial rollouts colocated and split at ahead 3, CISPO; each run stops once its reward has reached the bar
test-learning: $(VPY)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) -m "learning and not gpu" $(PYTEST_ARGS)

# all three, what CI runs
test-all: test test-slow test-learning

test-gpu: $(VPY)
	$(VPY) -m pytest -q -m gpu $(PYTEST_ARGS)

# the training modes (sync, overlap colocated, split placement + partial rollouts; on one GPU overlap + partial
# rollouts colocated) on the GPUs of this box with vLLM, 7 minutes on one H200: a table, and a JSON + PNG in runs/bench/<UTC time>/; exits 1 naming each mode that failed.
# Needs GPUs and vLLM (.venv/bin/pip install -e '.[vllm]'); on CPU: make bench ARGS=--cpu-smoke (plumbing only)
bench: $(VPY)
	$(VPY) benchmarks/modes.py --gpus $(GPUS) $(ARGS)

# runs/ holds every run's output, make bench's runs/bench/ included
clean:
	rm -rf runs outputs .pytest_cache
