# Two commands a newcomer needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   ?= out/demo

.PHONY: setup room test test-fast test-transformers5 demo bench clean

setup: $(STAMP)

# The pinned set is about 7 GB in .venv (torch's CUDA wheels), and pip keeps the ~3 GB of wheels it downloads
# until they are installed: 10.2 GiB at the peak (measured). Where the disk has less room, a warning comes first: a
# full disk stops pip halfway with "No space left on device", and `make setup` again, once there is room, finishes
# the install. `make room` checks alone.
SETUP_NEEDS_GB ?= 11
ROOM := $(PYTHON) -c "import shutil, sys, tempfile; \
	free = min(shutil.disk_usage(p).free for p in ('.', tempfile.gettempdir())) / 2**30; \
	free >= $(SETUP_NEEDS_GB) or print(f'make setup: warning: {free:.1f} GB free here; the pinned install needs \
	about $(SETUP_NEEDS_GB) GB (7 in .venv, the rest while pip downloads)', file=sys.stderr)"

room:
	@$(ROOM)

# The pinned set (requirements.lock) is what was resolved and verified; the package goes in editable. pip compiles
# the 41,800 installed modules one at a time (131 s of a 261 s install here); compileall on every CPU writes the same
# files in 87 s on two. A module it cannot compile is left as pip leaves it: Python reads its source.
$(STAMP): requirements.lock setup.py
	@$(ROOM)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements.lock
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

# Our own modules' bytecode, written before the tests: where PYTHONDONTWRITEBYTECODE is set (as on this machine),
# every process of the suite that imports them (ranks, Ray workers, commands) compiles them again, 0.2 CPU-s for
# the trainer's 61.
OWN_BYTECODE := $(PY) -m compileall -q diffusion > /dev/null

# One pytest worker per usable CPU (tests/conftest.py), a test file's tests on one worker (they share
# module fixtures), files in the collection's order (longest first: tests/conftest.py), not xdist's default
# of the files with the most tests first; `$(PY) -m pytest tests/...` runs in one process as before.
XDIST := -n auto --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	@$(OWN_BYTECODE)
	$(PY) -m pytest tests $(XDIST)

test-fast: $(STAMP)
	@$(OWN_BYTECODE)
	$(PY) -m pytest tests -m "not slow" $(XDIST)

# The GPU image's stack has transformers 5: the text-encoder, tokenizer, captioning and sampling tests
# again with transformers 5 (and the huggingface-hub and tokenizers it needs) laid over the pinned set.
TF5 := .cache/transformers5
test-transformers5: $(STAMP)
	@test -d $(TF5)/transformers || $(PY) -m pip install -q --no-deps --target $(TF5) \
		"transformers>=5,<6" "huggingface-hub>=1.31,<2" "tokenizers>=0.23.1,<0.24" typer
	PYTHONPATH=$(TF5) $(PY) -m pytest tests/convert/test_long_captions.py tests/convert/test_encoders.py \
		tests/convert/test_recaption.py tests/kit tests/models tests/sample tests/train/test_text_ids.py

# make demo RECIPE=unet trains the other recipe (the SD2 UNet); BATCHES=1000 a shorter run (slow machines)
demo: $(STAMP)
	$(PY) -m diffusion.demo --out $(DEMO) $(if $(RECIPE),--recipe $(RECIPE)) $(if $(BATCHES),--batches $(BATCHES)) $(if $(CURATE),--curate)

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf out .cache .pytest_cache
