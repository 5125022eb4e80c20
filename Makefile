# The two commands of the README:
#   make demo   set everything up, then run the tiny CPU demo on the local executor
#   make test   set everything up, then run the test suite
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: setup task slurm demo test lint mutate
setup:
	bash tools/setup_env.sh

task: setup
	$(PY) tools/build_tiny_task.py

demo: task
	.venv/bin/hpcrl submit configs/demo.toml

# A local Slurm (2 fake nodes, 2 fake GPUs each) for the tests marked `slurm`; needs root.
slurm:
	bash tools/slurm_up.sh --nodes 2 --gpus 2

test: task slurm
	$(PY) -m pytest -v -ra --durations=25 $(PYTEST_ARGS)

# Mutation testing of the core modules, each against its fast tests (docs/testing.md; about 15 min).
# MUTATE_ARGS picks groups and options, e.g. make mutate MUTATE_ARGS="algorithms --diffs".
mutate: task
	$(PY) tools/mutate.py $(MUTATE_ARGS)

lint: setup
	.venv/bin/ruff check hpcrl stages tools tests
