PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint typecheck unit bench clean lock

EXTRAS := dev,torch,plots

# installs exactly the versions CI tested (requirements.lock), within pyproject's ranges
$(STAMP): pyproject.toml requirements.lock
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -e '.[$(EXTRAS)]'
	touch $(STAMP)

# re-resolves within pyproject's ranges in a scratch venv and pins the result
lock:
	rm -rf .lock-venv && $(PY) -m venv .lock-venv
	.lock-venv/bin/pip install -q --upgrade pip
	.lock-venv/bin/pip install -q -e '.[$(EXTRAS)]'
	{ echo "# Exact versions CI tests with (make test / make demo install from this file)."; \
	  echo "# Refresh after changing a range in pyproject.toml: make lock"; \
	  .lock-venv/bin/pip freeze --exclude-editable | grep -v '^#' \
	    | sed -E 's/^(torch==[^+]*)\+.*/\1/'; } > requirements.lock
	rm -rf .lock-venv

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetplan plan --model gpt3-6.7b --cluster examples/clusters/a100x32.yaml --top 8 --out demo_plan.json

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# every core: about 12 min of pytest on CI's 2 cores, the tests marked slow handed out
# first (tests/conftest.py); a test group that shares files (the README's tour) stays on
# one worker
unit: $(STAMP)
	$(BIN)/pytest -n auto --dist loadgroup

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
