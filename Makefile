# One command sets up and runs each job on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup test figures demo bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

figures: $(STAMP)
	$(BIN)/nbattn figures

demo: $(STAMP)
	$(BIN)/nbattn demo

bench-cpu: $(STAMP)
	$(BIN)/nbattn bench --cpu

clean:
	rm -rf $(VENV) .pytest_cache
