# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-compile test-gpu test-llm test-slow lint bench bench-gpu faults soak docs clean install

install: $(STAMP)

# torch and torchvision are pinned to the releases this machine keeps on disk
# (plain pip finds them there; a newer release would download a multi-GB CUDA build).
# Graphviz draws partitions (fxpipe.draw); where apt-get cannot install it, a matplotlib
# renderer stands in. Chromium (headless) opens the page `fxpipe inspect --html` writes in
# its test; where apt-get cannot install it, that test skips.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -e '.[dev]'
	command -v dot >/dev/null || ! command -v apt-get >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null; } || echo "graphviz not installed: partition drawings use the matplotlib renderer"
	command -v chromium >/dev/null || ! command -v apt-get >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || echo "chromium not installed: the test of the fxpipe inspect --html page skips"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/ruff check fxpipe passes tests examples
	$(BIN)/python -m pytest -q -x -p no:cacheprovider

# compiled stages (Plan(compile=True)) against eager stages over every schedule x float64 /
# float32 x recompute (tests/test_compiled.py's compile_grid) and the compiled-stages benchmark's
# --quick run (Inductor: about 4 minutes on 2 cores)
test-compile: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m compile_grid tests/test_compiled.py tests/test_benchmarks.py

# the GPU path (CPU+cuda:0 stages, own streams, bf16, NCCL with 2 GPUs); skips without CUDA
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_distributed.py -k "gpu or cuda or GPU"

# every LLM family x torchrun layout against eager (tests/test_llm_torchrun.py, slow cases
# included), the families' trace-level grid, the MoE and hybrid families (tests/test_moe_families.py),
# the vision-language families (tests/test_vlm_families.py), ModernBERT's eager mask
# (tests/test_eager_masks.py), and two torchrun agents as two hosts (about 20 minutes on 2 cores); the command line's -m
# replaces pyproject's -m 'not slow'
test-llm: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_llm_torchrun.py tests/test_llm_families.py tests/test_moe_families.py tests/test_vlm_families.py tests/test_eager_masks.py tests/test_multinode.py

# every test, the slow cases of every file included (test-llm's grid, the ResNet-50
# detection models, HF listed micro-batches on sharded replicas, ...; 23 minutes here)
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "slow or not slow"

# every figure in docs/results.md's benchmark sections (about 40 minutes on 2 cores)
bench: $(STAMP)
	$(BIN)/python examples/benchmarks/executor_overhead.py
	$(BIN)/python examples/benchmarks/autosplit.py --plot docs/img/tune-sweep.png
	$(BIN)/python examples/benchmarks/compile.py
	$(BIN)/python examples/benchmarks/compiled.py
	$(BIN)/python examples/benchmarks/distributed.py
	$(BIN)/python examples/benchmarks/numerics.py
	$(BIN)/python examples/benchmarks/rng_overhead.py
	$(BIN)/python examples/benchmarks/signatures.py
	$(BIN)/python examples/benchmarks/varlen.py
	$(BIN)/python examples/benchmarks/zero_bubble.py --plots docs/img
	$(BIN)/python examples/benchmarks/dualpipev.py
	$(BIN)/python examples/benchmarks/titan.py --plot docs/img/titan.png
	$(BIN)/python examples/benchmarks/memory.py --plot docs/img/memory-predicted-vs-measured.png
	$(BIN)/python examples/benchmarks/data_parallel.py

# the GPU figures: bf16 autocast on cuda:0, CPU+GPU placement, one vs two GPUs (about 10
# minutes); refuses to run without CUDA
bench-gpu: $(STAMP)
	@$(BIN)/python -c "import sys, torch; torch.cuda.is_available() or sys.exit('make bench-gpu: no CUDA device on this machine')"
	$(BIN)/python examples/benchmarks/numerics.py
	mkdir -p build/gpu
	$(BIN)/python examples/heterogeneous_placement.py --plot build/gpu/heterogeneous.png
	$(BIN)/python examples/model_parallel_sweep.py --out build/gpu

# the full fault grid: kill/hang/raise/nan x 4 stages x schedules x 3 fault points, a fresh
# world per run (about 30 minutes on 2 cores); tests/test_faults.py runs a sample of it
faults: $(STAMP)
	$(BIN)/python examples/benchmarks/faults.py

# 200 short 2-rank torchrun jobs under a busy loop per core, counting clean exits, aborts
# (SIGABRT at exit), other failures and hangs; then 40 faulted jobs (raise, nan, kill, stop x
# 2 and 4 ranks x 5), counting aborts among the survivors, right blame in the launcher's
# summary and exit status, and seconds from the fault to the job's end; tests/test_soak.py
# runs a 3-job clean sample and 2 faulted jobs (raise, stop on 2 ranks)
soak: $(STAMP)
	$(BIN)/python examples/benchmarks/soak.py
	$(BIN)/python examples/benchmarks/soak.py --faults raise,nan,kill,stop --ranks 2,4 --repeats 5 --no-load

# every output quoted in docs/tutorial.md, docs/inspection.md and docs/examples.md, printed
# again by its command and rewritten in place, with the pictures those commands draw
# (examples/refresh_docs.py; about 30 minutes on 2 cores); tests/test_docs_outputs.py
# checks the cheap ones in `make test`
docs: $(STAMP)
	$(BIN)/python examples/refresh_docs.py

clean:
	rm -rf $(VENV) build *.egg-info
