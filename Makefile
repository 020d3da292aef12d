# Every target installs what it needs into .venv first (python3 >= 3.10 required).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: demo test lint docs bench package-check clean

# The runtime dependencies only: what a user installs, and all the demo needs.
$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# Everything the tests, the linters and the benchmarks need on top.
$(VENV)/.installed: $(VENV)/.runtime
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.runtime
	$(PY) examples/quickstart.py

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check ray_ps_plugin tests benchmarks examples tools
	$(VENV)/bin/ruff format --check ray_ps_plugin tests benchmarks examples tools
	$(VENV)/bin/mypy

# The docs site as MkDocs builds it; --strict fails on broken links and anchors.
$(VENV)/.docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d $(VENV)/site

package-check: $(VENV)/.installed
	bash .ci/package_check

bench: $(VENV)/.installed
	$(PY) benchmarks/step_time.py

clean:
	rm -rf $(VENV) .pytest_cache
