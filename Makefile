# The two commands of the README: `make run` (the main job) and `make test`. Both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup mpi run test lint bench clean

setup:
	@bash scripts/bootstrap.sh

run: setup
	$(BIN)/meshkit train

# The multi-process tests run the same training under Open MPI's mpirun: Debian's openmpi-bin.
mpi:
	@command -v mpirun >/dev/null 2>&1 || { \
	  echo "meshkit setup: installing openmpi-bin (for the mpirun tests)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq openmpi-bin >/dev/null; }

test: setup mpi lint
	$(BIN)/python -m pytest -n 2 -q --durations=25

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/bench_ledger.py
	$(BIN)/python benchmarks/bench_plans.py

clean:
	rm -rf $(VENV) .pytest_cache
