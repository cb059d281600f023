# ppspec — the two commands a new user needs: `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
MODEL   ?= models/qwen35-demo
PORT    ?= 8000
export PYTHONUNBUFFERED := 1

.PHONY: install tools test test-gpu test-gpu-flashinfer run proto demo-model bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,bench]'
	@# xgrammar declares triton; a CPU torch has no use for it, and with triton present
	@# transformers may route linear attention to GPU kernels (xgrammar's CPU path needs none)
	$(BIN)/python -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' && $(BIN)/pip uninstall -y -q triton || true
	$(MAKE) proto
	touch $@

install: tools $(VENV)/.installed

# System tools the deploy tests run (Debian packages; Python ones come with the `test` extra).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
tools:
	@command -v docker-compose >/dev/null && command -v promtool >/dev/null && command -v prometheus >/dev/null || \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends docker-compose prometheus; }

proto: | $(BIN)/python
	$(BIN)/python -m ppspec.proto.build

test: install
	$(BIN)/python -m pytest -q tests --ignore=tests/gpu -m 'not gpu' --timeout 1200

# GPU kernels against their torch references; the system python of the GPU machine
# (torch + triton there; fla from wheels on PYTHONPATH if present). Only tests/gpu is
# collected, so CPU-side test modules need not import there.
# FlashInfer's tests (marker `flashinfer`) need the flashinfer package, absent from the
# machine's image: they have their own target, and fail (not skip) without it.
test-gpu:
	$(PY) -m pytest -q tests/gpu -m 'gpu and not flashinfer' -p no:cacheprovider

test-gpu-flashinfer:
	$(PY) -m pytest -q tests/gpu -m flashinfer -p no:cacheprovider

run: install
	$(BIN)/ppspec demo --model $(MODEL) --port $(PORT)

demo-model: install
	$(BIN)/python models/train_demo.py --out models/qwen35-demo

clean:
	rm -rf $(VENV) build *.egg-info
