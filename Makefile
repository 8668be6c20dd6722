# mmkv developer entry points. `make demo` and `make test` work on a fresh clone (they set up first).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheels that pair with torchvision (see README: PyPI's torchvision fails beside torch 2.13).
TORCH := torch==2.14.1 torchvision==0.29.1
OUT ?= out

.PHONY: setup demo test samples bench clean

$(BIN)/mmkv: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/mmkv

setup: $(BIN)/mmkv

demo: setup
	mkdir -p $(OUT)
	$(BIN)/mmkv encode samples/clip.mp4 --model tiny-qwen2-vl --method full -o $(OUT)/clip.kvpack --force
	$(BIN)/mmkv ask $(OUT)/clip.kvpack "what color is the circle?"
	$(BIN)/mmkv encode samples/clip.mp4 --model tiny-llava-ov --method recency --budget 0.25 -o $(OUT)/clip-recency.kvpack --force
	$(BIN)/mmkv inspect $(OUT)/clip-recency.kvpack
	$(BIN)/mmkv encode samples/clip.mp4 --model tiny-llava-ov --method mukv -o $(OUT)/clip-mukv.kvpack --force
	$(BIN)/mmkv ask $(OUT)/clip-mukv.kvpack "what happened first?" --explain --max-new-tokens 4
	$(BIN)/mmkv profile samples/clip.mp4 --model tiny-llava-ov --methods full,recency,rekv,mukv --plot $(OUT)/profile.png

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python bench/ask_cost.py

samples: setup
	$(BIN)/python samples/make_samples.py

clean:
	rm -rf $(OUT) .pytest_cache
