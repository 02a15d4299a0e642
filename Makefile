# The two commands of the README: `make run` (the main job) and `make test`. Both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint bench clean

setup:
	@bash scripts/bootstrap.sh

run: setup
	$(BIN)/meshkit devices --simulate 8
	$(BIN)/meshkit comm meshkit.examples:dp_mlp_adam --devices 8
	$(BIN)/meshkit memory meshkit.examples:fsdp_mlp_grad --devices 8

test: setup lint
	$(BIN)/python -m pytest -n 2 -q

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/bench_ledger.py

clean:
	rm -rf $(VENV) .pytest_cache
