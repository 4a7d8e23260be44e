# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing and install the package with every extra. torch is pinned to the
# CPU wheel (2.13.0): an unpinned torch would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
DEMO   := runs/demo

.PHONY: install demo demo-clean images test bench chromium faketime system-tools phoenix titan titan-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[torch,lightning,transformers,telemetry,analysis,stacks,mcp,dev]' $(TORCH)
	touch $(STAMP)

install: $(STAMP)

# The repository's own modules compiled once: where PYTHONDONTWRITEBYTECODE=1 is set (container images
# set it, this machine's too) Python never caches them, and each of the suite's ~400 processes (ranks,
# launchers, CLI runs) compiled otel_train again: 0.45 s against 0.23 s to import the CLI and analyses
# (docs/benchmarks.md, "The suite"). Cached .pyc files are still read under that variable.
BYTECODE = @$(BIN)/python -m compileall -q -j 0 otel_train exporters examples tests benchmarks >/dev/null

# Debian's chromium drives the real Perfetto UI in tests/test_perfetto_ui.py; Debian's libfaketime gives
# each "host" of tests/test_clock_torchrun.py a clock of its own; Debian's libfuse2 lets fusepy mount the
# hung FUSE file system of tests/faults/test_fault_stall_write.py. One apt-get for whichever is missing
# (two at once would fight over dpkg's lock when make runs them side by side).
CHROMIUM_OK := command -v chromium >/dev/null 2>&1
FAKETIME_OK := test -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1
LIBFUSE_OK  := test -e /usr/lib/x86_64-linux-gnu/libfuse.so.2
system-tools:
	@missing=""; $(CHROMIUM_OK) || missing="$$missing chromium"; $(FAKETIME_OK) || missing="$$missing faketime"; \
	$(LIBFUSE_OK) || missing="$$missing libfuse2"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian$$missing for the Perfetto UI, multi-host clock and FUSE tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	  || echo "warning: could not install$$missing; the tests that need it will skip"; fi

chromium faketime: system-tools

# Arize Phoenix (a real OTLP backend) lives in its own venv: it is large.
phoenix:
	@bash .ci/phoenix-venv.sh || echo "warning: could not install Phoenix; its tests will skip"

# torchtitan 0.3.0 (its real trainer and structured logger in tests/test_titan_*.py) lives in its own venv:
# its datasets pin needs huggingface-hub < 2, the transformers extra >= 2.4 (.ci/titan-venv.sh).
titan-deps:
	@TORCH=$(TORCH) bash .ci/titan-venv.sh deps || echo "warning: could not install torchtitan; its tests will skip"
titan: install titan-deps
	@TORCH=$(TORCH) bash .ci/titan-venv.sh package || echo "warning: could not install torchtitan; its tests will skip"

# The story: a clean run, a straggler, a hang caught live by watch, a desync, each diagnosed on screen
# (examples/demo.py; docs/demo.md). `make demo-clean` is the single quiet run with its full reports.
demo: install
	$(BYTECODE)
	$(BIN)/python examples/demo.py --out $(DEMO)

demo-clean: install
	rm -rf $(DEMO)/clean
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=4 examples/train_ddp.py --save-path $(DEMO)/clean
	$(BIN)/otel-train summarize $(DEMO)/clean
	$(BIN)/otel-train whatif $(DEMO)/clean
	$(BIN)/otel-train export $(DEMO)/clean
	@echo
	@echo "Trace files:     $(DEMO)/clean/structured_logs/"
	@ls -l $(DEMO)/clean/structured_logs/
	@echo "Perfetto trace:  $(DEMO)/clean/analysis/structured_trace.json"
	@echo "Open it at https://ui.perfetto.dev (Open trace file), or offline: $(BIN)/vizviewer $(DEMO)/clean/analysis/structured_trace.json"

# The README's pictures: the demo's straggler run, and a job's profiler window merged by export --profiles,
# in the real Perfetto UI (tests/test_perfetto_ui.py).
images: install chromium
	test -d $(DEMO)/straggler/structured_logs || $(BIN)/python examples/demo.py --out $(DEMO) --only straggler
	$(BIN)/otel-train export $(DEMO)/straggler --steps 20-21 --output $(DEMO)/straggler/analysis/steps-20-21.json
	mkdir -p docs/images
	OTEL_TRAIN_IMAGES=docs/images OTEL_TRAIN_DEMO_TRACE=$(DEMO)/straggler/analysis/steps-20-21.json \
	  $(BIN)/python -m pytest -q tests/test_perfetto_ui.py -k "pictures or profiler"

# Two workers (pytest-xdist), one test file each at a time: a third of the suite is real multi-rank
# jobs that wait on one another, so two files overlap on the two cores (docs/benchmarks.md, "The suite").
# pytest-xdist's own order: the longest files first put the multi-rank jobs side by side (slower).
# The four installs (this venv, Debian's tools, Phoenix's and torchtitan's venvs) wait on the network, so
# they run side by side.
test:
	@$(MAKE) --no-print-directory -j4 -Otarget install system-tools phoenix titan
	$(BYTECODE)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

# The fault suite with more trials; rewrites docs/reliability.md's table (tests/faults/report.py).
.PHONY: faults
faults: install
	$(BIN)/python tests/faults/report.py --trials $${FAULT_TRIALS:-100} --examples $${FUZZ_EXAMPLES:-5000}

# Deliberate breakages of the package's key rules, each applied to a temporary copy of the repository and
# run against the tests that must catch it (tests/mutations.py; docs/architecture.md, "Tests"). Not part of
# `make test`: it prints the breakages that survive and fails if any does. MUTATIONS="-k clock" picks some.
.PHONY: mutations
mutations: install
	nice -n 10 $(BIN)/python tests/mutations.py $(MUTATIONS)

bench: install
	$(BIN)/python benchmarks/span_overhead.py
	$(BIN)/python benchmarks/train_overhead.py
	$(BIN)/python benchmarks/analysis_throughput.py
	$(BIN)/python benchmarks/watch_scale.py
	$(BIN)/python benchmarks/scale_sim.py
	$(BIN)/python benchmarks/profile_trigger.py

clean:
	rm -rf runs build dist *.egg-info .pytest_cache
