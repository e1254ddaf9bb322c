PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,torch]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetplan plan --model gpt3-6.7b --cluster examples/clusters/a100x32.yaml --top 8 --out demo_plan.json

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
