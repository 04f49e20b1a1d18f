# The two quick-start commands; each one installs (quick and harmless when already installed) and runs.
#   make train              deepspeed examples/pretrain_postnorm.sh on the embedded default corpus (the
#                           launcher of PYTHON's environment, python -m deepspeed.launcher.runner: activated or not)
#   make test               ruff check . && lint-imports && python -m pytest -q   (the unit tier; CI runs it first)
#   make test-integration   the tests that start processes, ranks or trainer runs (CI runs it second)
#   make test-slow          the long multi-rank runs (on demand, not in CI); tiers: docs/testing.md
#   make golden             three real runs compared value for value with benchmarks/golden/golden.json
#                           (GOLDEN_BASE=REV: with REV's runs recorded on this machine instead)
#   make law                refit the delayed-collapse law from study/results (megapost-law fit; torch-free)
# Variables: TORCH= skips the torch pin (GPU users bring their own CUDA torch); PYTHON=python3.11;
#   ARGS="--train-iters 1000" (flags for the example); LAUNCHER="--master_port 29600" (flags for the
#   deepspeed launcher, e.g. another port or --num_gpus 2); PYTEST_ARGS="-k resume" (added to pytest).
PYTHON ?= python
TORCH ?= torch==2.13.0
ARGS ?=
LAUNCHER ?=
PYTEST_ARGS ?=
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/megapost/torch_extensions

.PHONY: install train test test-integration test-slow golden law

install:
ifneq ($(strip $(TORCH)),)
	$(PIP) "$(TORCH)"
endif
	$(PIP) -e ".[dev,hf]"

train: install  # MASTER_PORT, else a free port (printed); LAUNCHER's --master_port wins over both
	@port=$${MASTER_PORT:-$$($(PYTHON) -m megapost.utils.ports)}; echo "master port $$port (set MASTER_PORT to choose)"; \
	accel=$$($(PYTHON) -c 'import megapost, os; print(os.environ["DS_ACCELERATOR"] if "DS_ACCELERATOR" in os.environ else "")'); \
	env $${accel:+DS_ACCELERATOR=$$accel} $(PYTHON) -m deepspeed.launcher.runner --master_port $$port $(LAUNCHER) \
	  examples/pretrain_postnorm.sh $(ARGS)

test: install
	ruff check .
	lint-imports --no-cache  # the import layering of pyproject.toml [tool.importlinter]
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

test-integration: install
	$(PYTHON) -m pytest -q -m "integration and not slow" $(PYTEST_ARGS)

test-slow: install
	$(PYTHON) -m pytest -q -m slow $(PYTEST_ARGS)

golden: install  # a refactor must reproduce every value bit for bit (~4 min on 2 free cores; GOLDEN_BASE=REV: against REV run here)
	$(PYTHON) benchmarks/golden/record.py $${GOLDEN_OUT:-/tmp/megapost-golden.json} \
	  $(if $(GOLDEN_BASE),--base $(GOLDEN_BASE),--compare benchmarks/golden/golden.json)

# the factor study's sweeps (failure to start; short runs, cosine): the boundary law's data, kept as shipped
BOUNDARY_DATA := study/results/grid_w20/boundary.json $(addprefix study/results/,heads init length \
	paper_512x48 seq tokens vocab warmup warmup_depth width)
law:  # the shipped study data -> megapost/study/{boundary,hazard}_law_post.json (docs/study_results.md)
	$(PYTHON) -m megapost.study boundary $(BOUNDARY_DATA) --out megapost/study/boundary_law_post.json
	$(PYTHON) -m megapost.study fit
