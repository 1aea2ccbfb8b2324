# The two commands a newcomer needs (README.md): `make demo` and `make test`.
# Each creates .venv, installs the project with what it needs, and the host packages (as root).
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION ?= 2.13.0
HOST_PACKAGES := systemd-container debootstrap zstd openssh-client iproute2 util-linux iputils-ping rsync shellcheck

.PHONY: demo plan check test lint host-packages clean gpu-check

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch (a plain `torch>=2.13` would pull a multi-GB CUDA build), with the project.
	# pip byte-compiles what it installs one file at a time, which took over a minute here: compile on
	# every core instead, leaving out the ~36,000 files of Ansible's bundled collections, which run on
	# the nodes, not here. Like pip, take a file written for a newer Python (torch ships one) as it is.
	$(BIN)/pip install -q --no-compile 'torch==$(TORCH_VERSION)' -e '.[aws,ansible,report,trainer,tracking,test]'
	$(BIN)/python -m compileall -qq -j 0 -x '/ansible_collections/' $(VENV)/lib || true
	touch $@

# Local nodes need systemd-nspawn, debootstrap and an SSH client on the host; the tests lint the
# scripts fsdpctl runs on the nodes with shellcheck (tests/fsdpctl/test_script_templates.py).
host-packages:
	@missing=$$(for p in $(HOST_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing host packages: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

demo: $(STAMP) host-packages
	$(BIN)/fsdpctl demo examples/local.yaml

plan: $(STAMP)
	$(BIN)/fsdpctl plan examples/demo.yaml

lint: $(STAMP)
	$(BIN)/ruff check .

# The loop to run while working (README): lint, then every test that boots no local node and is not
# marked slow, on every core. `make test` runs them all, as CI does.
check: $(STAMP) lint
	$(BIN)/pytest -q -m "not root and not slow" -n auto

# Everything, in one session: TEST_WORKERS test files at a time, the ones that boot local nodes or are
# slow first, then the others, which fill the cores while the last node files wait on their nodes
# (tests/scheduling.py). A file's tests stay on one worker, as its module fixture boots the nodes they
# share, in a subnet of its own; the files that share the session's demo cluster count as one file
# (tests/local/demo_cluster.py). Node tests wait on boots, Slurm and timeouts, so more workers than
# cores pay off: on 2 cores the CPU was idle for 14 % of the node tests with two workers and 4 % with
# three (vmstat).
TEST_WORKERS ?= 3
test: $(STAMP) host-packages lint
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile

# On a machine with 1+ NVIDIA GPUs (docs/gpu-check.md): uses the Python that has CUDA torch (PYTHON=...),
# not the CPU venv above. OUT=DIR for the results, GPU_CHECK_ARGS='--dry-run' etc. for the options.
gpu-check:
	bench/gpu_check.sh $(if $(OUT),--out $(OUT)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build
