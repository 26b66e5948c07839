# Everything a user or CI runs. `make up STACK=dev` deploys, `make test` proves.
STACK ?= dev
PYTHON ?= python3
VENV := venv
BIN := $(CURDIR)/$(VENV)/bin
# Used only when no backend is configured (no `pulumi login`, no PULUMI_BACKEND_URL).
LOCAL_BACKEND ?= file://$(HOME)/.pulumi-llm-platform
# The policy pack runs in its own venv, as the CLI runs it.
POLICY_VENV := policy/venv
POLICY_FLAGS = --policy-pack policy --policy-pack-config policy/config/$(STACK).json

.PHONY: help install install-dev up preview destroy render upgrade-status test lint unit e2e bench bench-quick golden-urns clean twin local \
	system-deps-test system-deps-twin pin-base lock-workloads config-docs whatif

help:
	@echo "make up STACK=dev|prod       deploy a stack (creates the venv, logs in, selects the stack)"
	@echo "make preview STACK=dev|prod  show what would change"
	@echo "make destroy STACK=dev|prod  tear a stack down (the model bucket and ECR repo are retained)"
	@echo "make render STACK=dev|prod   offline render under mocks into build/render/<stack>/"
	@echo "make upgrade-status STACK=prod  each RayService's upgrade phase and likely cause, from kubectl"
	@echo "make test                    lint, type-check and every test, the real server and both twins included"
	@echo "make twin STACK=dev|prod     the stack's RayServices on a local Ray cluster, checked by Ray's own code"
	@echo "make local STACK=dev         the stack served at http://127.0.0.1:8000/v1 until Ctrl-C (MODEL=/path for your model, PORT= another port)"
	@echo "make bench                   serving overhead and render-scale benchmarks -> benchmarks/results/"
	@echo "make bench-quick             the same code path once, small (under 3 min): a check, not a measurement"
	@echo "make pin-base                re-resolve the serving image's base and the router front's tags to digests (needs the registries)"
	@echo "make lock-workloads          re-lock workloads/requirements.txt with hashes (needs PyPI)"
	@echo "make whatif STACK=prod [TRACE=file.jsonl]  replay a trace with each routing policy"

$(VENV)/.program: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	touch $@

$(POLICY_VENV)/.installed: policy/requirements.txt
	$(PYTHON) -m venv $(POLICY_VENV)
	$(POLICY_VENV)/bin/pip install -q -r policy/requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.program requirements-dev.txt requirements-checkov.txt workloads/requirements-e2e.txt policy/requirements.txt scripts/install-test-deps.sh
	bash scripts/install-test-deps.sh $(BIN)
	touch $@

install: $(VENV)/.program
install-dev: $(VENV)/.dev

# Picks a backend when none is configured, selects or creates the stack,
# and makes sure the API keys secret exists before Pulumi runs.
define with_stack
	@command -v pulumi >/dev/null || { echo "the Pulumi CLI is required: https://www.pulumi.com/docs/install/"; exit 1; }
	@pulumi whoami >/dev/null 2>&1 || { echo "no Pulumi backend configured: using $(LOCAL_BACKEND)"; \
		mkdir -p "$(HOME)/.pulumi-llm-platform"; pulumi login "$(LOCAL_BACKEND)"; }
	@pulumi stack select $(STACK) 2>/dev/null || pulumi stack init $(STACK)
	@pulumi config get llm-platform:api_keys --stack $(STACK) >/dev/null 2>&1 || { \
		echo "generating an API key for $(STACK): read it with 'pulumi config get llm-platform:api_keys' (the key follows 'default:')"; \
		pulumi config set --secret llm-platform:api_keys "default:$$(openssl rand -hex 32)" --stack $(STACK); }
endef

up: $(VENV)/.program $(POLICY_VENV)/.installed
	$(with_stack)
	pulumi up $(POLICY_FLAGS) --stack $(STACK)

preview: $(VENV)/.program $(POLICY_VENV)/.installed
	$(with_stack)
	pulumi preview --diff $(POLICY_FLAGS) --stack $(STACK)

# The model bucket and the ECR repository are protected: destroy leaves them.
destroy: $(VENV)/.program
	$(with_stack)
	pulumi destroy --exclude-protected --stack $(STACK)

render: $(VENV)/.program
	$(BIN)/python -m infra.render --stack $(STACK)

# The configuration reference, from the config model; a test fails until the
# rewritten page is committed. Written aside first: a failed run keeps the page.
config-docs: $(VENV)/.program
	$(BIN)/python -m infra.config_reference > docs/configuration.md.new
	mv docs/configuration.md.new docs/configuration.md

# When `pulumi up` times out waiting for a RayService: which phase each one is
# in and the likely cause, read with kubectl from the stack's serving namespace
# (exit 1 unless all are steady). CONTEXT= picks the kubeconfig context.
upgrade-status: $(VENV)/.program
	$(BIN)/python -m infra.upgrade_status --stack $(STACK) $(if $(CONTEXT),--context $(CONTEXT))

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint workloads/Dockerfile infra/aws/router_front/Dockerfile
	$(BIN)/shellcheck scripts/*.sh
	$(BIN)/actionlint

unit: $(VENV)/.dev
	$(BIN)/python -m pytest -q -m "not e2e"

# E2E_REQUIRED: a missing vLLM/Ray fails the run instead of skipping the server test.
e2e: $(VENV)/.dev
	E2E_REQUIRED=1 $(BIN)/python -m pytest -q -m e2e

# System packages (apt-get as root, else one line naming them): scripts/system-deps.sh.
system-deps-test:
	@bash scripts/system-deps.sh test

system-deps-twin:
	@bash scripts/system-deps.sh twin

# tests/run.py: the latency tests alone, then the tests that start no server
# two at a time, then the end-to-end tests one at a time (both stacks' twins
# included, with their Prometheus and every alert's fault; TWIN_MONITORING=0
# leaves those out), then bench-quick, the benchmark's whole code path once,
# so it can not rot between the runs someone measures with.
# Lint runs inside the suite, beside the tests that start no server (tests/run.py).
test: system-deps-test $(VENV)/.dev $(VENV)/.bench
	PYTHONUNBUFFERED=1 $(BIN)/python -m tests.run

# The local twin of every RayService of a stack: Ray's own code reads the
# render (ray start, autoscaling config, Serve LLM's bundles), then a local
# multi-node cluster shaped like it serves, scales and wakes (under 10 min);
# a real Prometheus scrapes it with the render's monitors and rules, and each
# alert fires on its own fault (twin/observe.py, about 5 min more);
# then day 2 (twin/day2.py): a load-balancer change, an upgrade at peak, and
# a NewCluster upgrade under load with KubeRay's sequence (about 8 min).
twin: system-deps-twin $(VENV)/.dev
	PYTHONUNBUFFERED=1 $(BIN)/python -m infra.twin --stack $(STACK) --monitoring
	PYTHONUNBUFFERED=1 $(BIN)/python -m twin.day2 --stack $(STACK)

# The twin left running for a person: http://127.0.0.1:8000/v1 with a key it
# prints, until Ctrl-C. MODEL=/path/to/model serves that directory, PORT= another port.
local: $(VENV)/.dev
	PYTHONUNBUFFERED=1 $(BIN)/python -m twin.local --stack $(STACK) $(if $(MODEL),--model-dir $(MODEL)) $(if $(PORT),--port $(PORT))

# `pip check` after the install: a pin that conflicts with what the venv
# already holds (the dev and e2e requirements) fails here, not at import.
$(VENV)/.bench: $(VENV)/.dev benchmarks/requirements.txt
	$(BIN)/pip install -q -r benchmarks/requirements.txt
	$(BIN)/pip check | { grep -E 'python-dateutil|matplotlib|contourpy|cycler|fonttools|kiwisolver|pillow|pyparsing|py-spy' && exit 1 || true; }
	touch $@

# Serving overhead against bare vLLM with vLLM's own benchmark client, and
# render scale; writes benchmarks/results/ (~20 min).
bench: system-deps-twin $(VENV)/.bench
	PYTHONUNBUFFERED=1 $(BIN)/python -m benchmarks

# Replays a request trace (JSON Lines: benchmarks/traces.py) through the
# stack's router with each routing policy on two local replicas; writes
# build/whatif/$(STACK).md. Without TRACE, replays vLLM's prefix_repetition
# case (55% of each prompt a shared prefix), written to build/whatif/prefix.jsonl.
TRACE ?= build/whatif/prefix.jsonl
whatif: system-deps-twin $(VENV)/.bench
	@test -f "$(TRACE)" || PYTHONUNBUFFERED=1 $(BIN)/python -m benchmarks.whatif --stack $(STACK) --generate $(TRACE)
	PYTHONUNBUFFERED=1 $(BIN)/python -m benchmarks.whatif --stack $(STACK) --trace $(TRACE)

# The same code path once and small (project, routed and bare, one round): under 3 min
# once the venv exists; fails on a failed request, a CPU layout that did not hold,
# or a server whose engine steps went unread.
bench-quick: system-deps-twin $(VENV)/.bench
	PYTHONUNBUFFERED=1 $(BIN)/python -m benchmarks --quick --out build/bench-quick

# Accept new or removed resources in the URN golden lists (review the diff: a
# changed URN is a replacement unless the resource carries an alias).
golden-urns: $(VENV)/.program
	$(BIN)/python -m tests.golden_urns

# The serving image's base by digest: resolves RAY_LLM_BASE_TAG where the
# registry is reachable and rewrites the digest in infra/versions.py and the
# Dockerfile default; review and commit the diff it prints.
pin-base: $(VENV)/.program
	PYTHON=$(BIN)/python bash scripts/pin-base.sh

# What the image adds, by version and sha256 (workloads/requirements.lock),
# after a change to workloads/requirements.txt.
lock-workloads: $(VENV)/.program
	$(BIN)/python scripts/lock_workloads.py

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
