# mmkv developer entry points. `make demo` and `make test` work on a fresh clone (they set up first).
# Any supported Python (3.11-3.14): `make setup PYTHON=python3.13`
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch and torchvision as a pair that imports together (PyPI's torchvision failed beside torch 2.13).
# Without a GPU, setup takes the CPU-only builds (about 200 MB) from PyTorch's index when it answers,
# else PyPI's (CUDA builds on Linux, about 6.6 GB). CPU=1 insists on the CPU builds, CPU=0 on PyPI's,
# TORCH_INDEX names any other index. A changed PYTHON or choice rebuilds the venv (scripts/setup_venv.sh).
TORCH := torch==2.14.1 torchvision==0.29.1
CPU ?=
TORCH_INDEX ?=
OUT ?= out
# demo-grid's last training run: cuda where a GPU is, and processes rendering its clips ahead
# (7 kept an H100 busy)
TRAIN_DEVICE ?= cpu
TRAIN_WORKERS ?= 0

.PHONY: setup demo demo-model test test-matrix docs docs-figures wheel-check samples bench bench-scale bench-gpu gpu-wheels clean

setup:
	@PYTHON='$(PYTHON)' VENV='$(VENV)' TORCH='$(TORCH)' CPU='$(CPU)' TORCH_INDEX='$(TORCH_INDEX)' \
		scripts/setup_venv.sh

demo: setup
	mkdir -p $(OUT)
	$(BIN)/mmkv encode samples/clip.mp4 --model demo --method full -o $(OUT)/clip.kvpack --force
	$(BIN)/mmkv ask $(OUT)/clip.kvpack "what color is the circle ?"
	$(BIN)/mmkv ask $(OUT)/clip.kvpack "which shape appeared first ?"
	$(BIN)/mmkv encode samples/clip.mp4 --model demo --method mukv -o $(OUT)/clip-mukv.kvpack --force
	$(BIN)/mmkv ask $(OUT)/clip-mukv.kvpack "which shape appeared last ?" --explain
	$(BIN)/mmkv encode samples/clip.mp4 --model demo --method hermes --budget-tokens 24 -o $(OUT)/clip-hermes.kvpack --force
	$(BIN)/mmkv inspect $(OUT)/clip-hermes.kvpack
	$(BIN)/mmkv ask $(OUT)/clip-hermes.kvpack "which shape appeared last ?" --json
	$(BIN)/mmkv profile samples/clip.mp4 --model demo --methods full,recency,rekv,mukv,hermes --question "which shape appeared first ?" --plot $(OUT)/profile.png
	@echo
	@echo "mmkv is installed in $(VENV): run 'source $(VENV)/bin/activate' to put it on your PATH"
	@echo "(or call $(BIN)/mmkv); for fast answers, a warm server: MMKV_KEEP_ALIVE=10m (docs/warm.md)"

# Retrain the demo backbone (mmkv_cli/assets/demo.safetensors): about 70 minutes on 2 CPU cores; resumes.
# Two runs: 5000 steps from scratch, then 2000 steps at a lower rate with every clip length from the start
# (no curriculum), which lifted shape questions.
demo-model: setup
	mkdir -p $(OUT)
	$(BIN)/python scripts/train_demo_model.py --out $(OUT)/demo-base.safetensors
	$(BIN)/python scripts/train_demo_model.py --init $(OUT)/demo-base.safetensors --out $(OUT)/demo.safetensors \
		--steps 2000 --lr 3e-4 --curriculum 0 --seed 11
	cp $(OUT)/demo.safetensors mmkv_cli/assets/demo.safetensors
	# demo-grid (issue 19): the grid world at 16 tokens a frame, started from demo's weights (its
	# patch position embeddings resized to the 8 x 8 patch grid); each run resumes from its .ckpt.
	# The first run learns the grid's shapes and questions (the shipped base: the best eval, step
	# 1,500, of a 2,400-step schedule stopped at 1,800);
	# demo's tower carries no place, so the second runs a grid stage 1 whose position embeddings
	# learn 20x faster (token quadrant 0.25 -> 1.00 in 200 steps), then questions (step 500 of
	# 750, shipped until the third; see docs/eval-demo.md).
	$(BIN)/python scripts/train_demo_model.py --world grid --init mmkv_cli/assets/demo.safetensors \
		--vision-steps 0 --out $(OUT)/demo-grid-base.safetensors --steps 1500 --eval-every 300 \
		--lr 5e-4 --frames 4,8,16,32,64
	$(BIN)/python scripts/train_demo_model.py --world grid --init $(OUT)/demo-grid-base.safetensors \
		--vision-steps 500 --place-lr 20 --out $(OUT)/demo-grid.safetensors --steps 750 \
		--eval-every 250 --eval-clips 48 --lr 5e-4 --curriculum 0 --frames 4,8,16,32,64 --seed 12
	# The shipped weights come from a third run, trained on a GPU (issue 19: about 10 minutes on
	# one H100, 7 processes rendering clips; on 2 CPU cores the same 3,000 steps take about a day):
	# a stage 1 whose head reads the shape's quadrant from a frame's mean token (--frame-where),
	# then questions at batch 32 (held-out 0.896, "where" 0.68; the best eval, step 2,500).
	$(BIN)/python scripts/train_demo_model.py --world grid --init $(OUT)/demo-grid.safetensors \
		--vision-steps 300 --frame-where 1 --place-lr 20 --out $(OUT)/demo-grid-gpu.safetensors \
		--steps 3000 --batch 32 --eval-every 250 --eval-clips 96 --lr 1e-3 --curriculum 0 \
		--frames 4,8,16,32,64 --seed 22 --device $(TRAIN_DEVICE) --workers $(TRAIN_WORKERS)
	cp $(OUT)/demo-grid-gpu.safetensors mmkv_cli/assets/demo-grid.safetensors

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(OUT)/site
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests
	VENV=$(VENV) .ci/wheel_check

# Every entry of the supported matrix (.ci/matrix.txt): a fresh venv per Python / torch pair from the
# built wheel, then encode, ask, inspect, verify, the facade and serve. `.ci/run` runs the oldest and
# newest entries; this runs them all (about 6 minutes each, and 4 more for each Python it builds).
test-matrix:
	.ci/matrix all matrix

# The documentation site (docs/, mkdocs material) into site/; `make test` builds it with --strict.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The docs' figures (docs/figures/*.png) from bench/results; tests/test_docs_figures.py checks that
# each was drawn from its results file as it is now.
docs-figures: setup
	$(BIN)/python scripts/docs_figures.py

# The built wheel, installed in a fresh venv outside the checkout, runs methods / encode / ask.
wheel-check: setup
	VENV=$(VENV) .ci/wheel_check

# Speed and memory goals (issues 3, 5, 6, 36): results in bench/results/. A few minutes on 2 CPU cores.
bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python bench/ask_cost.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/hermes_memory.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/decode_cost.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/serve.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/warm.py --wide-frames 64
	HF_HUB_OFFLINE=1 $(BIN)/python bench/serve_streams.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/quant.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/fuzz.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/batch.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/live.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/per_head.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/early_write.py
	$(BIN)/python bench/media_read.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/media_prep.py

# Real scale (issue 16): rehearsal models at real width over 64-1800 frames. About 45 minutes on 2 CPU
# cores at one layer; on a GPU run `python bench/scale.py --layers 0` for the full depth in bf16.
# Then what checkpoints cost at that width (about 17 minutes).
bench-scale: setup
	HF_HUB_OFFLINE=1 $(BIN)/python bench/scale.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/checkpoint_writes.py

# What only a GPU shows (issue 48), under 8 minutes on one H100: CPU / CUDA parity of every method and
# reducer, host syncs per chunk, the bare prefill floor, and scale / reduce / live at 7B full depth.
# Results in bench/results/gpu-*.json. `python bench/gpu.py --quick --device cpu` checks the script
# (its results in bench/results/quick/).
bench-gpu: setup
	HF_HUB_OFFLINE=1 $(BIN)/python bench/gpu.py

# A GPU machine with no network whose image holds torch but not all of mmkv's needs (docs/benchmarks.md,
# "On a lent machine"): the missing wheels, at this venv's versions, for its Python, into .whl/
GPU_PYTHON ?= 3.12
GPU_WHEELS ?= transformers av blake3
gpu-wheels: setup
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl \
		$$($(BIN)/python -c 'import importlib.metadata as m, sys; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $(GPU_WHEELS))
	@ls .whl

samples: setup
	$(BIN)/python samples/make_samples.py

clean:
	rm -rf $(OUT) .pytest_cache
