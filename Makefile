# The two commands of the README:
#   make demo   installs everything and runs the demo pipeline (offline, CPU, ~7 min)
#   make test   installs everything and runs the test suite
#
# torch is installed on its own, first: a plain `torch` requirement would pull several GB
# of CUDA packages on a CPU machine. Where pip has a CPU wheel of torch==2.13.0 at hand
# (this project's machines do), that wheel is taken. Elsewhere, pass the CPU wheel index:
#   make demo TORCH_PIP_ARGS="--index-url <your PyTorch CPU wheel index>"
# On a GPU machine, TORCH_PIP_ARGS="" installs the default CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/dpdistill run --config configs/demo.yaml

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs .cache
