# The whole set-up on a fresh machine (Python >= 3.10, pip, make): `make reproduce` and `make test`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REPRODUCE_ARGS ?=
# `make reproduce` runs as NPROC processes of one thread under torchrun (one per core, or per GPU; the bytes of one
# process of one thread: outlierscope.parallel); NPROC=1 for a single process
NPROC ?= $(shell $(BIN)/python -c "from outlierscope.parallel import local_processes; print(local_processes())")
RUN = OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m outlierscope
# the real model's part of `make reproduce` (1.7 of its 27.8 minutes on 2 cores: bench/results/make_reproduce.json)
REAL_MODEL ?= smollm2-135m
REAL_ARGS ?= --seq-len 512 --tokens 10000 --limit 50

.PHONY: install data reproduce test lint docs docs-check bench notebooks lmeval-venv lmeval-compare llmc-venv gptq-venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed explicitly first: a bare `torch` requirement would pull a multi-GB CUDA build. The rest under
# constraints.txt (the tested versions): a new transformers once changed which architectures a clean clone supports.
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,lmeval]"
	touch $(STAMP)

install: $(STAMP)

data: $(STAMP)
	$(BIN)/outlierscope data fetch

# `reproduce` with the arguments $(1): checked in one process first (a bad one is one line, not one per process and
# torchrun's report), then run as NPROC processes
CHECKED_REPRODUCE = $(BIN)/outlierscope reproduce --check $(1) && $(RUN) reproduce $(1)

# NPROC given on the command line or in the environment: a whole number >= 1, checked before anything runs
ifneq ($(filter reproduce,$(MAKECMDGOALS)),)
ifneq ($(filter command line environment,$(origin NPROC)),)
ifneq ($(shell printf '%s' '$(NPROC)' | grep -Eqx '[1-9][0-9]*' || echo bad),)
$(error NPROC must be a whole number of processes >= 1, got '$(NPROC)'; leave it out for one per core)
endif
endif
endif

reproduce: install data
	$(call CHECKED_REPRODUCE,$(REPRODUCE_ARGS))
	$(BIN)/outlierscope models fetch $(REAL_MODEL)
	$(call CHECKED_REPRODUCE,--model $(REAL_MODEL) $(REAL_ARGS) --out runs/reproduce-$(REAL_MODEL))

lint: install
	$(BIN)/ruff check .

# the documentation site (mkdocs.yml: guide, results, API reference from the docstrings) into build/site, offline;
# --strict: a broken link, a missing page or include, an unrenderable docstring is an error
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# the built site read in a real browser: headless Chromium (Debian's: apt-get install chromium) over every page
# reachable from the navigation, on localhost (tools/check_site.py)
docs-check: docs
	$(BIN)/python tools/check_site.py

# the real model too: tests/models/test_smollm2_checkpoint.py compares a W8A8 checkpoint of it with the emulation
test: install data lint docs
	$(BIN)/outlierscope models fetch $(REAL_MODEL)
	$(BIN)/python -m pytest -q

# every notebook run top to bottom in place, outputs kept (they are committed with them)
notebooks: install data
	$(BIN)/python notebooks/execute.py

bench: install data
	$(BIN)/python bench/profile_throughput.py
	$(BIN)/python bench/quant.py

# lm-evaluation-harness 0.4.13 in a venv of its own (lm-eval alone, nothing of ours), for bench/eval_vs_lmeval.py
.venv-lmeval/.installed:
	$(PYTHON) -m venv .venv-lmeval
	.venv-lmeval/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	.venv-lmeval/bin/python -m pip install -q --disable-pip-version-check "lm_eval[hf]==0.4.13" "transformers==5.24.0"
	touch $@

lmeval-venv: .venv-lmeval/.installed

# LMEVAL_MODEL: any HF directory, e.g. ~/.cache/outlierscope/models/smollm2-135m (after `outlierscope models fetch smollm2-135m`)
LMEVAL_MODEL ?= outlierscope/pretrained/pair-tiny/diff
lmeval-compare: install data lmeval-venv
	$(BIN)/python bench/eval_vs_lmeval.py --model $(LMEVAL_MODEL) $(LMEVAL_ARGS)

# llm-compressor 0.14.0.1 in a venv of its own (it pins compressed-tensors 0.19.0 and transformers <= 5.17), for
# references/llmc_oneshot.py: a compressed-tensors checkpoint from an `outlierscope export` (docs/checkpoints)
.venv-llmc/.installed:
	$(PYTHON) -m venv .venv-llmc
	.venv-llmc/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	.venv-llmc/bin/python -m pip install -q --disable-pip-version-check "llmcompressor==0.14.0.1"
	touch $@

llmc-venv: .venv-llmc/.installed

# GPT-QModel 7.6.0 + optimum in a venv of their own (gptqmodel 7.7 wants torch >= 2.14), for references/gptq_fixtures.py
# (the GPTQ/AWQ checkpoints under tests/models/packed) and references/gptq_oneshot.py (docs/checkpoints' GPTQ model)
.venv-gptq/.installed:
	$(PYTHON) -m venv .venv-gptq
	.venv-gptq/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	.venv-gptq/bin/python -m pip install -q --disable-pip-version-check "gptqmodel==7.6.0" "optimum==2.3.0" "transformers==5.24.0"
	touch $@

gptq-venv: .venv-gptq/.installed

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
