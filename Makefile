# The two set-up commands: `make demo` and `make test`. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test opinfo coverage lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.11,<2.16"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/ruff check torch_tpu tests tools examples
	$(BIN)/python -m pytest tests
	TORCH_TPU_EAGER_MODE=fused $(BIN)/python -m pytest tests

opinfo: $(STAMP)
	TORCH_TPU_OPINFO=all $(BIN)/python -m pytest tests/test_opinfo.py

coverage: $(STAMP)
	$(BIN)/python tools/opinfo_coverage.py --write README.md --expect tests/opinfo_expected.json

lint: $(STAMP)
	$(BIN)/ruff check torch_tpu tests tools examples

bench: $(STAMP)
	$(BIN)/python -m torch_tpu.bench dispatch

clean:
	rm -rf $(VENV)
