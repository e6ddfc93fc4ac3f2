# iq36 — two commands: `make serve` and `make test`. Everything else is set up on demand.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
IQ36 := $(BIN)/iq36
# The venv is rebuilt when the pins change (the stamp is named by their hash).
DEPS_HASH := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
STAMP := $(VENV)/.stamp-$(DEPS_HASH)

MODEL ?= dev-tiny
ENGINE ?= candidate
HOST ?= 127.0.0.1
PORT ?= 8000
PROFILE ?= cpu
PYTEST_ARGS ?=

.PHONY: help setup native models serve test lint clean-venv

help:
	@echo "make serve   set up, build dev-tiny if needed, start the service on http://$(HOST):$(PORT)"
	@echo "             (MODEL=dev-tiny|dev-bench|dev-bench-256|DIR  ENGINE=candidate|stock  PORT=8000)"
	@echo "make test    set up, build the test models if needed, run the whole test suite"
	@echo "make setup   create .venv with the pinned runtime, builder and test dependencies"
	@echo "make native  build iq36's OpenVINO extension ops (g++; cached by content, also built on first use)"
	@echo "make lint    ruff"

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@rm -f $(VENV)/.stamp-*
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip==25.3"
	$(BIN)/pip install --quiet -c constraints.txt -e '.[build,gate,test]'
	@# optimum-intel pulls a CUDA torchvision that breaks model import beside torch+cpu (FACTS.md).
	$(BIN)/pip uninstall --quiet --yes torchvision 2>/dev/null || true
	touch $@

native: setup
	$(BIN)/python -m kernels.native

models: native
	$(IQ36) model build dev-tiny
	$(IQ36) model build dev-tiny-f32

serve: native
	$(if $(filter dev-%,$(MODEL)),$(IQ36) model build $(MODEL),)
	$(IQ36) serve --model $(MODEL) --engine $(ENGINE) --profile $(PROFILE) --host $(HOST) --port $(PORT)

test: models
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/python -m ruff check .

clean-venv:
	rm -rf $(VENV)
