# hookwire — the two set-up commands are `make run` and `make test`.
CARGO ?= cargo
LISTEN ?= 127.0.0.1:50051

.PHONY: run test lint fmt build release clean demo

## Serve the embedded default (agent `demo` on the scripted model, no hooks).
run:
	$(CARGO) run --release --bin hookwire -- serve --listen $(LISTEN)

## Demo: hookwire + the Python example hook server + the scripted model; one
## run shows a redaction, a denied tool and a remote tool (examples/demo/).
demo:
	CARGO=$(CARGO) bash examples/demo/run.sh

## The whole suite: unit, integration (real servers on port 0), lint.
test: lint
	$(CARGO) test --all-targets

## Format check and clippy with warnings as errors.
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

build:
	$(CARGO) build

release:
	$(CARGO) build --release

clean:
	$(CARGO) clean
