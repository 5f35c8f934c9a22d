# hookwire — the two set-up commands are `make run` and `make test`.
CARGO ?= cargo
LISTEN ?= 127.0.0.1:50051

.PHONY: run test lint bench fmt build release clean

## Serve the embedded default (agent `demo` on the scripted model, no hooks).
run:
	$(CARGO) run --release --bin hookwire -- serve --listen $(LISTEN)

## The whole suite: unit, integration (real servers on port 0), lint.
test: lint
	$(CARGO) test --all-targets

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
