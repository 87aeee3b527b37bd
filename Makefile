# Two commands a newcomer needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   ?= out/demo

.PHONY: setup test test-fast demo bench clean

setup: $(STAMP)

# The pinned set (requirements.lock) is what was resolved and verified; the package goes in editable.
$(STAMP): requirements.lock setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

test: $(STAMP)
	$(PY) -m pytest tests

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow"

demo: $(STAMP)
	$(PY) -m diffusion.demo --out $(DEMO)

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf out .cache .pytest_cache
