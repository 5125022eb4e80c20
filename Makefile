# The two commands of the README:
#   make demo   set everything up, then run the tiny CPU demo on the local executor
#   make test   set everything up, then run the test suite
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: setup task demo test lint
setup:
	bash tools/setup_env.sh

task: setup
	$(PY) tools/build_tiny_task.py

demo: task
	.venv/bin/hpcrl submit configs/demo.toml

test: task
	$(PY) -m pytest -v -ra $(PYTEST_ARGS)

lint: setup
	.venv/bin/ruff check hpcrl stages tools tests
