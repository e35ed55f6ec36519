# One command sets up and runs each job on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# A machine with an NVIDIA driver gets the CUDA build of torch, numba-cuda's
# NVVM wheels for the driver's CUDA major version, and the GPU tests.  Any other
# machine gets torch's CPU build, asked for by its "+cpu" version (found on a
# local wheel mirror, else on torch's CPU index): never a CUDA build by chance.
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(GPU),yes)
CUDA_MAJOR := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
CU := $(if $(filter 13,$(CUDA_MAJOR)),cu13,cu12)
EXTRAS := dev,docs,gpu-$(CU)
else
EXTRAS := dev,docs
endif

DOCS_HTML := docs/_build/html

.PHONY: setup test test-gpu docs figures demo bench-cpu notebooks student clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
ifeq ($(GPU),yes)
	$(BIN)/pip install --quiet -c constraints.txt torch==$(TORCH_VERSION)
else
	$(BIN)/pip install --quiet -c constraints.txt torch==$(TORCH_VERSION)+cpu \
	  || $(BIN)/pip install --quiet -c constraints.txt --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION)+cpu
endif
	$(BIN)/pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

# The test suite, then the documentation site (warnings are errors) and its
# browser test; on a GPU machine also the GPU-marked tests.
test: $(STAMP)
	$(BIN)/nbattn doctor
	$(BIN)/python -m pytest -n 2 -q -m "not gpu and not docs"
	$(MAKE) docs
	NBATTN_DOCS_HTML=$(DOCS_HTML) $(BIN)/python -m pytest -q -m docs tests/test_docs_site.py
ifeq ($(GPU),yes)
	$(MAKE) test-gpu
endif

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html -j 2 docs $(DOCS_HTML)

figures: $(STAMP)
	$(BIN)/nbattn figures

demo: $(STAMP)
	$(BIN)/nbattn demo

bench-cpu: $(STAMP)
	$(BIN)/nbattn bench --cpu

notebooks: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[$(EXTRAS),notebooks]'
	$(BIN)/jupyter lab notebooks/

# The student edition: worked solutions removed, so every exercise check fails
# until it is answered.
student: $(STAMP)
	$(BIN)/python notebooks/_build.py --student student-notebooks

clean:
	rm -rf $(VENV) .pytest_cache docs/_build docs/jupyter_execute student-notebooks
