# The two commands of the README:
#   make demo   installs everything and runs the demo pipeline (offline, CPU, about 7 min on 2 idle cores)
#   make test   installs everything and runs the test suite
#
# Both install the exact versions this project tests, from constraints.txt; pyproject.toml
# only holds ranges (so `pip install -e .` into an environment of your own keeps its torch).
#
# torch is installed on its own, first: a plain `torch` requirement would pull several GB
# of CUDA packages on a CPU machine. Its version is read from constraints.txt (torch==2.13.0, the
# public version, which any build satisfies); where pip has a CPU wheel of it at hand (this
# project's machines do), that wheel is taken. Only this step sees TORCH_PIP_ARGS: torch's own
# dependencies come from that index, and the next step moves them to the constrained versions.
# Elsewhere, pass the CPU wheel index:
#   make demo TORCH_PIP_ARGS="--index-url <your PyTorch CPU wheel index>"
# On a GPU machine, TORCH_PIP_ARGS="" installs the default CUDA build of the same version.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.installed
TORCH_VERSION := $(shell sed -n 's/^torch==//p' constraints.txt)

.PHONY: install demo test results clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/dpdistill run --config configs/demo.yaml

test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

# After a study's results file grew: the docs' stale report blocks and the README's figure, redrawn
# from docs/results/ (tests/test_docs.py fails until they are).
results: install
	$(BIN)/python experiments/refresh_reports.py README.md docs/*.md
	$(BIN)/python experiments/privacy_utility.py

clean:
	rm -rf runs .cache
