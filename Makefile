# hookwire — the two set-up commands are `make run` and `make test`.
CARGO ?= cargo
LISTEN ?= 127.0.0.1:50051

# The suite's Python tools (grpcio, fakellm, buf, kubectl, hadolint, ...) live
# in the project-local virtualenv that `make deps` makes: first on PATH, and
# the Python that tests start.
VENV := $(CURDIR)/.venv
export PATH := $(VENV)/bin:$(PATH)
export PYTHON := $(VENV)/bin/python

.PHONY: run test deps lint proto-check bench fuzz fmt build release clean demo

## Serve the embedded demo: agent `demo` on the scripted model, with the
## built-in demo hook server (redaction, a tool, a denied tool).
run:
	$(CARGO) run --release --bin hookwire -- serve --listen $(LISTEN)

## Demo: hookwire + the Python example hook server + the scripted model; one
## run shows a redaction, a denied tool and a remote tool (examples/demo/).
demo: deps
	CARGO=$(CARGO) bash examples/demo/run.sh

## The whole suite: dependencies, lint, unit and integration tests (real
## servers on port 0), and the offline checks of deploy/ with the binary just
## built.
test: deps lint
	$(CARGO) test --all-targets
	HOOKWIRE_BIN=target/debug/hookwire deploy/check.sh

## What the suite needs (Debian packages, .venv, npm), installed only when
## missing: a fresh machine needs nothing else; see deploy/deps.sh.
deps:
	deploy/deps.sh

## Format check, clippy with warnings as errors, and the proto checks.
lint: deps proto-check
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

## The contract: buf lint, and buf breaking against the last released
## contract, a committed buf image (no network, no git tags). On a release,
## add that version's image (see proto/released/README.md) and point this at it.
PROTO_RELEASED := proto/released/hookwire-v0.1.0.binpb
proto-check: deps
	buf lint proto
	buf breaking proto --against $(PROTO_RELEASED)

## Property-based fuzzing of the boundaries (hook verdicts, client requests,
## the OpenAI stream parser and retry logic): the properties `make test` runs
## a few hundred times, FUZZ_CASES times each (debug build, so integer
## overflow panics too; ~10 min at the default).
FUZZ_CASES ?= 20000
fuzz:
	PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test --lib fuzz_
	PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test --test fuzz

## Benchmarks (the `production` profile's settings, loopback, a few minutes): prints the table and
## writes target/bench/results.json; see BENCHMARKS.md.
bench: deps
	$(CARGO) bench --bench hookwire

fmt:
	$(CARGO) fmt --all

build:
	$(CARGO) build

## The binary that ships (whole-program optimised, Cargo.toml's `production`
## profile): target/production/hookwire. `make run` builds the quicker `release`.
release:
	$(CARGO) build --profile production

clean:
	$(CARGO) clean

# deploy-check (offline validation of deploy/) and image (OCI archive, offline).
include deploy/deploy.mk
