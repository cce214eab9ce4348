# The two commands (see README.md):
#   make demo   set up .venv if needed, then train a small DLRM on built-in data
#   make test   set up .venv with the test extras if needed, lint and type-check (make lint),
#               then run the whole suite
#   make fuzz   the readers' property tests with 10000 generated inputs each (see below)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint setup clean mutants fuzz

$(VENV)/.stamp-base: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# The CPU build of torch 2.13.0 is installed first where no torch is present:
	@# a bare `torch` requirement would pull a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	@# Build the C++ CPU kernels now (about a minute, once per version of the sources and
	@# CPU kind; cached under ~/.cache/tetrarec), so that no run pays for it. Without a
	@# compiler this warns and tetrarec uses its portable PyTorch path; in CI (CI=true, as
	@# .ci/run sets it) or with TETRAREC_KERNELS=compiled a failed build fails here.
	$(PY) -c "import tetrarec.kernels as k; print('tetrarec CPU kernels:', 'compiled' if k.build_cpu_kernels() else 'portable path')"
	@touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

setup: $(VENV)/.stamp-base

demo: $(VENV)/.stamp-base
	$(VENV)/bin/tetrarec demo

test: lint
	$(PY) -m pytest -q
	@# The sharded paths again on the portable PyTorch kernels: the per-table loop (this
	@# lane found a storage-offset bug in their column copies that the compiled kernels
	@# hid), then the batched path a GPU runs (about 50 s each on 2 cores).
	TETRAREC_KERNELS=reference $(PY) -m pytest -q tests/distributed/test_sharding_equivalence.py
	TETRAREC_KERNELS=batched $(PY) -m pytest -q tests/distributed/test_sharding_equivalence.py

# ruff, then mypy --strict on the package (settings in pyproject.toml); mypy keeps its
# incremental cache in .mypy_cache, so a re-run checks only what changed.
lint: $(VENV)/.stamp-test
	$(PY) -m ruff check tetrarec tests benchmarks
	$(PY) -m ruff format --check tetrarec tests benchmarks
	$(PY) -m mypy tetrarec

# Deep fuzzing, not part of `make test` (which runs tests/fuzz/ with a few hundred
# examples per property, the same ones each run): every property of tests/fuzz/ with
# FUZZ_EXAMPLES generated inputs, drawn afresh each run (tests/fuzz/conftest.py), then
# Hypothesis's count of inputs tried per test. Each input has a 10 s deadline; a test
# that hangs outright is stopped after FUZZ_TIMEOUT seconds. About an hour on 2 cores.
FUZZ_EXAMPLES ?= 10000
FUZZ_TIMEOUT ?= 3600
fuzz: $(VENV)/.stamp-test
	TETRAREC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider \
	  --timeout=$(FUZZ_TIMEOUT) --hypothesis-show-statistics tests/fuzz

# Mutation testing, not part of `make test` (mutation/README.md): mutmut over the kernels,
# metrics, checkpoint state and parsers ([tool.mutmut] in pyproject.toml), then the seeded
# C++ kernel bugs of mutation/cpp_mutants.py. Both report a score and every survivor.
# Narrow the runs with MUTMUT_NAMES (mutmut name globs, e.g. "tetrarec.train.metrics*")
# and CPP_MUTANTS (e.g. "--only adam_global_step"). Hours on 2 cores: see the README.
# The mutated Python copy builds its kernels in its own cache (it sits at another path).
MUTMUT_NAMES ?=
CPP_MUTANTS ?=
mutants: $(VENV)/.stamp-test
	$(PY) -m pip install -q -e ".[mutation]"
	@# Build the kernels into the mutants' cache first (the build is keyed by the sources'
	@# content, which mutmut never changes): a first build inside the stats run takes
	@# minutes and trips the first kernel test's timeout, and mutmut then gives up.
	@# mutation/sharded_state_mutants.py runs the train/state.py mutants that only sharded
	@# (spawned) ranks reach, which mutmut reports as "no tests".
	XDG_CACHE_HOME=$(CURDIR)/mutants/xdg-cache TETRAREC_KERNELS=compiled $(PY) -c \
	  "from tetrarec.kernels._build import compiled_cpu_kernels; compiled_cpu_kernels()"
	XDG_CACHE_HOME=$(CURDIR)/mutants/xdg-cache $(VENV)/bin/mutmut run $(MUTMUT_NAMES); \
	rm -f mutants/sharded-state.json; \
	case "$(MUTMUT_NAMES)" in ""|*train.state*|*train\**|*tetrarec\**) \
	  XDG_CACHE_HOME=$(CURDIR)/mutants/xdg-cache $(PY) mutation/sharded_state_mutants.py \
	    --mutmut $(VENV)/bin/mutmut --json mutants/sharded-state.json;; esac; \
	$(PY) mutation/mutmut_score.py --mutmut $(VENV)/bin/mutmut \
	  $$(test -f mutants/sharded-state.json && echo --sharded mutants/sharded-state.json); \
	py=$$?; \
	$(PY) mutation/cpp_mutants.py $(CPP_MUTANTS); cpp=$$?; \
	test $$py -eq 0 -a $$cpp -eq 0

clean:
	rm -rf $(VENV) build *.egg-info
