# The two set-up commands: `make demo` and `make test`. Both create .venv on a fresh machine.
# `make test-newest` and `make test-oldest` run a shorter pass on the newest and oldest torch the
# package declares, each in its own venv (see "Tested versions" in the README); CI runs all three.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PINNED_TORCH := 2.13.0
NEWEST_TORCH := 2.15.0
OLDEST_TORCH := 2.11.0
OLDEST_JAX := 0.10.1
# The shorter pass: the device, training, compile, fused, distributed, estimator and fft tests (the
# docs pages' examples use these same APIs and run in the full pass), less the TPU-target tests
# (libtpu's compiler does not depend on torch's version), DDP over 4 ranks (DDP over 2 runs), and,
# for CI's budget, tests of what torch's version does not reach: the program cache's files on disk,
# a distributed script's output through pytest and a pipe, and three of the Estimator's five
# data-parallel cases (one per sharding, and the compiled one, stay).
SHORT_TESTS := tests/test_device.py tests/test_training.py tests/test_compile.py tests/test_fused.py \
	tests/test_distributed.py tests/test_estimator.py tests/test_ops_fft.py -k 'not tpu_target' \
	--deselect 'tests/test_distributed.py::test_ddp_matches_single_process[4]' \
	--deselect tests/test_fused.py::test_persistent_cache_survives_corrupt_entries \
	--deselect tests/test_fused.py::test_an_unusable_cache_directory_warns_and_runs_on \
	--deselect tests/test_distributed.py::test_pytest_quiet_prints_its_closing_line_after_a_distributed_test \
	--deselect tests/test_distributed.py::test_a_distributed_script_prints_its_last_line_through_a_pipe \
	--deselect 'tests/test_estimator.py::test_data_parallel_equals_one_device[4-dp-auto-16]' \
	--deselect 'tests/test_estimator.py::test_data_parallel_equals_one_device[8-dp-auto-16]' \
	--deselect 'tests/test_estimator.py::test_data_parallel_equals_one_device[8-fsdp-auto-256]'
# The fused pass leaves out files that test nothing eager mode runs (the source layering, the import
# hook, the benchmark command, the extension's build, the docs pages, whose examples choose their own
# mode), files that choose their modes themselves (decode, estimator, estimator_generate, fused, spmd,
# recompile, target), and,
# for CI's budget, the compile and export files (a graph's ops are the same programs in both modes)
# and the distributed ones (each test starts ranks of its own; the estimator's data-parallel tests
# run their first step in fused mode).
FUSED_SKIP := tests/test_import_layers.py tests/test_autoload.py tests/test_bench.py tests/test_docs.py \
	tests/test_extension.py tests/test_decode.py tests/test_estimator.py tests/test_estimator_generate.py \
	tests/test_fused.py tests/test_spmd.py tests/test_recompile.py tests/test_target.py tests/test_compile.py tests/test_compile_cnn.py \
	tests/test_export.py tests/test_integrations_inductor.py tests/test_distributed.py
# The suite runs as several pytest processes, not one: every XLA:CPU executable a process loads keeps
# memory mappings (about 85 per OpInfo test, which compiles several programs), torch_tpu keeps its
# programs for reuse, and Linux's default vm.max_map_count (65,530) is reached after about 1,100
# tests; the next compile then segfaults inside XLA. torch_tpu now drops its programs past half that
# bound (runtime/residency.py); the split keeps reloads out of the suite's time. See docs/performance.md,
# "Long-running processes". tools/test_lanes.py runs the groups side by side, one per core (two on
# CI's machine): each pytest process keeps one core busy.
GROUP_OPINFO := tests/test_opinfo.py
GROUP_OPS := $(wildcard tests/test_ops_*.py) $(wildcard tests/test_*_conformance.py)
GROUP_REST := $(filter-out $(GROUP_OPINFO) $(GROUP_OPS),$(sort $(wildcard tests/test_*.py)))
GROUP_A_D := $(filter tests/test_a% tests/test_b% tests/test_c% tests/test_d%,$(GROUP_REST))
GROUP_E_L := $(filter tests/test_e% tests/test_f% tests/test_g% tests/test_h% tests/test_i% tests/test_j% \
	tests/test_k% tests/test_l%,$(GROUP_REST))
GROUP_A_L := $(GROUP_A_D) $(GROUP_E_L)
GROUP_M_Z := $(filter-out $(GROUP_A_L),$(GROUP_REST))
# The TPU compile group: the training, compile, graph and decode tests run with every program also
# compiled for a v5e chip (libtpu's compile-only client, on a worker thread; tests/conftest.py fails
# the group where one does not compile and prints the report), in place of their plain strict runs.
# The OpInfo gate under the target (`make test-tpu-target`) stays out: in a clean clone its ~2,500
# more TPU compiles cost CI's budget (docs/tpu-target.md).
TARGET_GROUP := tests/test_training.py tests/test_compile.py tests/test_graphs.py tests/test_decode.py
STRICT_A_D := $(filter-out $(TARGET_GROUP),$(GROUP_A_D))
STRICT_E_L := $(filter-out $(TARGET_GROUP),$(GROUP_E_L))
STRICT_M_Z := $(filter-out $(TARGET_GROUP),$(GROUP_M_Z))
# The fused pass runs GROUP_OPINFO, GROUP_A_L and GROUP_M_Z less FUSED_SKIP; not the per-op files
# (GROUP_OPS, 837 tests, about 470 s on CI's machine): an op's lowering is the same program in both
# modes, and the OpInfo gate runs every op through fused recording. Nor the OpInfo gate's compiled
# half (test_opinfo_compiled, two thirds of the fused OpInfo group's time): a one-op graph is the
# same program in both modes, as for the compile files above; fused mode's deferral of a compiled
# graph runs in the fused pass's training tests and in test_decode's fused cases.
FUSED_OPINFO := $(GROUP_OPINFO) -k 'not test_opinfo_compiled'
# LANES=N: how many groups run at once (default: one per core, memory allowing).
LANES ?=
FUSED := TORCH_TPU_EAGER_MODE=fused
# This machine's pip may carry a global constraint file that caps torch below the newest release;
# the extra venvs install exactly the versions named above, so they read an empty one instead.
NO_CAP := $(abspath .ci/no-constraints.txt)

.PHONY: demo test test-newest test-oldest test-versions extra-venvs install-check test-tpu-target opinfo coverage lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==$(PINNED_TORCH)" || $(BIN)/pip install -q "torch>=2.11,<2.16"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/python -P torch_tpu/core/extension.py
	touch $(STAMP)

# .venv-torch<version>: one venv per extra torch version, with the package installed editable.
.venv-torch%/.installed: pyproject.toml
	$(PY) -m venv .venv-torch$*
	.venv-torch$*/bin/pip install -q --upgrade pip
	PIP_CONSTRAINT=$(NO_CAP) .venv-torch$*/bin/pip install -q "torch==$*" $(if $(filter $*,$(OLDEST_TORCH)),"jax==$(OLDEST_JAX)" "jaxlib==$(OLDEST_JAX)")
	PIP_CONSTRAINT=$(NO_CAP) .venv-torch$*/bin/pip install -q -e ".[test]"
	.venv-torch$*/bin/python -P torch_tpu/core/extension.py
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The groups start longest first (their minutes on CI's machine), so that the two lanes end together.
test: $(STAMP)
	$(BIN)/ruff check torch_tpu tests tools examples _torch_tpu_autoload.py
	$(BIN)/python tools/test_lanes.py $(if $(LANES),--lanes $(LANES)) \
		"strict A-D: $(STRICT_A_D)" "strict ops: $(GROUP_OPS)" "strict E-L: $(STRICT_E_L)" \
		"strict M-Z: $(STRICT_M_Z)" "strict + v5e target: TORCH_TPU_TARGET=v5e $(TARGET_GROUP)" \
		"strict OpInfo: $(GROUP_OPINFO)" "fused M-Z: $(FUSED) $(filter-out $(FUSED_SKIP),$(GROUP_M_Z))" \
		"fused A-L: $(FUSED) $(filter-out $(FUSED_SKIP),$(GROUP_A_L))" "fused OpInfo: $(FUSED) $(FUSED_OPINFO)"

# Another torch ($(1)): the import line and the demo.
define version_check
	.venv-torch$(1)/bin/python -c "import torch, jax, torch_tpu.core.extension as e; \
		print('torch', torch.__version__, 'jax', jax.__version__, 'extension', e.available() or e.why_not())"
	.venv-torch$(1)/bin/python examples/demo.py
endef
# The shorter pass as a test_lanes group. The oldest torch's tests run as on a machine without a C++
# compiler: the extension is built (and the demo uses it) but the tests neither load it nor need it.
SHORT_NEWEST := "torch $(NEWEST_TORCH): @.venv-torch$(NEWEST_TORCH)/bin/python $(SHORT_TESTS)"
SHORT_OLDEST := "torch $(OLDEST_TORCH): TORCH_TPU_NO_EXTENSION=1 @.venv-torch$(OLDEST_TORCH)/bin/python $(SHORT_TESTS)"

# Both extra venvs, without testing: .ci/run builds them while `make test` runs (pip and the
# compiler beside pytest) and then runs the two shorter passes in them.
extra-venvs: .venv-torch$(NEWEST_TORCH)/.installed .venv-torch$(OLDEST_TORCH)/.installed

test-newest: .venv-torch$(NEWEST_TORCH)/.installed
	$(call version_check,$(NEWEST_TORCH))
	.venv-torch$(NEWEST_TORCH)/bin/python tools/test_lanes.py $(SHORT_NEWEST)

test-oldest: .venv-torch$(OLDEST_TORCH)/.installed
	$(call version_check,$(OLDEST_TORCH))
	.venv-torch$(OLDEST_TORCH)/bin/python tools/test_lanes.py $(SHORT_OLDEST)

# test-newest and test-oldest together, their two shorter passes side by side (what .ci/run runs).
test-versions: extra-venvs
	$(call version_check,$(NEWEST_TORCH))
	$(call version_check,$(OLDEST_TORCH))
	.venv-torch$(NEWEST_TORCH)/bin/python tools/test_lanes.py $(if $(LANES),--lanes $(LANES)) $(SHORT_NEWEST) $(SHORT_OLDEST)

# The sdist installed as a user installs it, into a fresh venv beside .venv's torch: the extension
# builds at the first import, and the demo trains (tools/check_install.py).
install-check: $(STAMP)
	$(BIN)/python tools/check_install.py

# The TPU compile pass: the OpInfo gate and the training, compile, graph and decode tests with every
# program also compiled for a v5e chip (libtpu's compile-only client); fails where one does not compile.
# `make test` runs its training, compile, graph and decode part (TARGET_GROUP); the whole pass, in a
# clean clone where nothing is in the analyses' cache, costs about 28 CPU minutes, more than CI's
# budget holds (docs/tpu-target.md).
TPU_TARGET_TESTS := tests/test_opinfo.py tests/test_training.py tests/test_compile.py tests/test_graphs.py \
	tests/test_decode.py
test-tpu-target: $(STAMP)
	TORCH_TPU_TARGET=v5e $(BIN)/python -m pytest $(TPU_TARGET_TESTS)

opinfo: $(STAMP)
	TORCH_TPU_OPINFO=all $(BIN)/python -m pytest tests/test_opinfo.py

coverage: $(STAMP)
	$(BIN)/python tools/coverage.py --expect --write README.md

lint: $(STAMP)
	$(BIN)/ruff check torch_tpu tests tools examples _torch_tpu_autoload.py

bench: $(STAMP)
	$(BIN)/python -m torch_tpu.bench dispatch

clean:
	rm -rf $(VENV) .venv-torch*
