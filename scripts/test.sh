#!/usr/bin/env bash
# The project's test command: lint, type-check, then the whole test suite.
KVCANARY_EXTRAS=test source "$(dirname "$0")/env.sh"
echo "[test] ruff" >&2
ruff check src tests benchmarks
echo "[test] mypy" >&2
mypy
echo "[test] pytest" >&2
pytest -q "$@"
