# The two commands of the README: `make run` (the main job) and `make test`. Both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint bench clean

setup:
	@bash scripts/bootstrap.sh

run: setup
	$(BIN)/meshkit train

test: setup lint
	$(BIN)/python -m pytest -n 2 -q

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/bench_ledger.py

clean:
	rm -rf $(VENV) .pytest_cache
