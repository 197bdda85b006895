# `make demo` and `make test` each create .venv from scratch when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-compat lint docs bench bench-core bench-load bench-export bench-manager bench-deepspeed bench-lightning bench-torchtitan bench-scale bench-nd bench-tiers bench-convert bench-compare bench-summary bench-gpu stress clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# libfuse3 for the power-loss harness (tests/powerloss, through mfusepy); its tests skip, saying why, where this cannot be had
	@if ! ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so' || ! command -v fusermount3 >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get install -y -q fuse3 libfuse3-3 >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fuse3 libfuse3-3 >/dev/null 2>&1)) \
				|| echo "note: could not install fuse3/libfuse3-3; the power-loss tests will skip"; \
		else echo "note: libfuse3 and fusermount3 are missing (apt-get install fuse3 libfuse3-3); the power-loss tests will skip"; fi; \
	fi
	$(PY) -m pip install -q --upgrade pip
	DS_BUILD_OPS=0 $(PY) -m pip install -q -r requirements-dev.txt
	# torchtitan as a real client (tests/integrations/test_torchtitan.py): without its training-only deps
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 torchdata==0.11.0
	# torchao's real tensor subclasses (float8 training, NF4, MX) for the subclass policy (tests/state/test_subclasses.py)
	$(PY) -m pip install -q --no-deps torchao==0.18.0
	$(PY) -m pip install -q -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardsafe demo

# The framework seams (src/shardsafe/compat/) at the oldest and the newest versions pyproject allows:
# one throwaway venv each under .venv-compat/, running the tests that use transformers, Accelerate and
# huggingface_hub (~6 min each on 2 cores, plus the installs). Not run by .ci/run: see README, "Compatibility".
COMPAT_MIN := transformers==5.3.0 accelerate==1.3.0 huggingface_hub==1.3.0
COMPAT_LATEST := transformers accelerate huggingface_hub
COMPAT_TESTS := tests/integrations/test_trainer.py tests/integrations/test_trainer_data_order.py tests/integrations/test_accelerate.py tests/hf/test_push.py
test-compat:
	@set -e; for which in min latest; do \
		venv=.venv-compat/$$which; \
		if [ $$which = min ]; then pins="$(COMPAT_MIN)"; else pins="$(COMPAT_LATEST)"; fi; \
		test -x $$venv/bin/python || $(PYTHON) -m venv $$venv; \
		$$venv/bin/python -m pip install -q "$$(grep '^torch==' requirements-dev.txt)" numpy pytest pytest-timeout hypothesis moto[server] fsspec s3fs; \
		$$venv/bin/python -m pip install -q --upgrade $$pins; \
		$$venv/bin/python -m pip install -q -e .; \
		echo "== test-compat $$which: $$($$venv/bin/python -m pip list 2>/dev/null | grep -iE '^(transformers|accelerate|huggingface.hub) ' | tr -s ' ' | paste -sd ';')"; \
		$$venv/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS); \
	done

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks tools
	$(PY) -m ruff format --check src tests benchmarks tools
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

# docs/ARCHITECTURE.md's layer tables, regenerated from the package (tests/core/test_layers.py checks they are current)
docs: $(STAMP)
	$(PY) tools/architecture.py

test: lint
	$(PY) -m pytest -q

stress: $(STAMP)
	$(PY) -m pip install -q atheris
	# the power-loss harness's full exploration writes its counts into docs/RELIABILITY.md (also when a test fails)
	rm -f $(VENV)/powerloss.jsonl
	SHARDSAFE_POWERLOSS_REPORT=$(CURDIR)/$(VENV)/powerloss.jsonl $(PY) -m pytest -q -m stress; status=$$?; \
		test ! -s $(VENV)/powerloss.jsonl || $(PY) tools/powerloss_report.py $(VENV)/powerloss.jsonl docs/RELIABILITY.md; exit $$status
	$(PY) tests/fuzz/fuzz_parsers.py -runs=20000
	$(PY) tests/fuzz/fuzz_deepspeed_unpickler.py -runs=20000
	$(PY) tests/fuzz/fuzz_dcp_metadata.py -runs=20000

# Each writes its own section of BENCHMARKS.md; `make bench` runs them all (~50 min on 2 cores).
bench: bench-core bench-load bench-export bench-manager bench-deepspeed bench-lightning bench-torchtitan bench-scale bench-nd bench-tiers
	$(PY) benchmarks/summary.py BENCHMARKS.md

# The table at the top of BENCHMARKS.md, from the sections below it (measures nothing).
bench-summary: $(STAMP)
	$(PY) benchmarks/summary.py BENCHMARKS.md

bench-core: $(STAMP)
	$(PY) benchmarks/run.py

bench-load: $(STAMP)
	$(PY) benchmarks/bench_load_one.py --md BENCHMARKS.md
	$(PY) benchmarks/bench_load.py --md BENCHMARKS.md

bench-export: $(STAMP)
	$(PY) benchmarks/bench_export.py --md BENCHMARKS.md

bench-manager: $(STAMP)
	$(PY) benchmarks/bench_manager.py

bench-lightning: $(STAMP)
	$(PY) benchmarks/bench_lightning.py --md BENCHMARKS.md

bench-torchtitan: $(STAMP)
	$(PY) benchmarks/bench_torchtitan.py --md BENCHMARKS.md

bench-deepspeed: $(STAMP)
	$(PY) benchmarks/bench_deepspeed.py --md BENCHMARKS.md

bench-scale: $(STAMP)
	$(PY) benchmarks/bench_scale.py --md BENCHMARKS.md

bench-nd: $(STAMP)
	$(PY) benchmarks/bench_nd.py --md BENCHMARKS.md

bench-tiers: $(STAMP)
	$(PY) benchmarks/bench_tiers.py --md BENCHMARKS.md

# Not part of `make bench`: `shardsafe convert` of bench-deepspeed's ZeRO-3 checkpoint, this tree against the commit
# before the fix that stopped every tensor being reassembled twice (a detached worktree in .bench-before/).
CONVERT_BEFORE := 2ae7ff1^
bench-convert: $(STAMP)
	test -d .bench-before || git worktree add --detach .bench-before $(CONVERT_BEFORE)
	$(PY) benchmarks/bench_convert.py --before .bench-before/src --md BENCHMARKS.md

# Not part of `make bench`: HEAD (this working tree) against REF (a worktree in .bench-ref/), alternately, ~12 min.
# Run it before calling a change to the save or load path done: make bench-compare REF=<the commit it started from>.
bench-compare: $(STAMP)
	$(PY) benchmarks/bench_compare.py --ref "$(REF)" $(if $(MD),--md $(MD))

# Not part of `make bench`: needs a CUDA GPU and a CUDA build of torch (stops with a message otherwise); < 8 min on one H200.
bench-gpu: $(STAMP)
	$(PY) benchmarks/bench_gpu.py --md BENCHMARKS.md

clean:
	rm -rf $(VENV) .venv-compat demo-run bench-run
