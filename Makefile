# hookwire — the two set-up commands are `make run` and `make test`.
CARGO ?= cargo
LISTEN ?= 127.0.0.1:50051

.PHONY: run test lint bench fmt build release clean demo

## Serve the embedded demo: agent `demo` on the scripted model, with the
## built-in demo hook server (redaction, a tool, a denied tool).
run:
	$(CARGO) run --release --bin hookwire -- serve --listen $(LISTEN)

## Demo: hookwire + the Python example hook server + the scripted model; one
## run shows a redaction, a denied tool and a remote tool (examples/demo/).
demo:
	CARGO=$(CARGO) bash examples/demo/run.sh

## The whole suite: lint, unit and integration tests (real servers on port
## 0), and the offline checks of deploy/ with the binary just built.
test: lint
	$(CARGO) test --all-targets
	HOOKWIRE_BIN=target/debug/hookwire deploy/check.sh

## Format check and clippy with warnings as errors.
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

## Benchmarks (release build, loopback, a few minutes): prints the table and
## writes target/bench/results.json; see BENCHMARKS.md.
bench:
	$(CARGO) bench --bench hookwire

fmt:
	$(CARGO) fmt --all

build:
	$(CARGO) build

release:
	$(CARGO) build --release

clean:
	$(CARGO) clean

# deploy-check (offline validation of deploy/) and image (OCI archive, offline).
include deploy/deploy.mk
