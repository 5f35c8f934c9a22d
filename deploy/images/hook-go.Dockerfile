# syntax=docker/dockerfile:1
# The Go example hook server (examples/hooks/go). From the repository root:
#   docker build -f deploy/images/hook-go.Dockerfile -t hookwire-example-go:0.1.0 .
# It builds the way the example's Makefile does here: Debian's Go, grpc-go and
# protoc packages in GOPATH mode, nothing fetched from a module proxy.
FROM debian:bookworm-slim AS build
# Versions come from the bookworm release the base tag names; pinning exact
# Debian revisions would break the build at every point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        golang-go golang-google-grpc-dev golang-google-protobuf-dev \
        protobuf-compiler protoc-gen-go protoc-gen-go-grpc make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY proto proto
COPY examples/hooks/go examples/hooks/go
# CGO off: a static binary for the distroless static base.
RUN CGO_ENABLED=0 make -C examples/hooks/go build

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /src/examples/hooks/go/bin/hook-server /usr/local/bin/hook-server
USER 65532:65532
EXPOSE 50062
ENTRYPOINT ["/usr/local/bin/hook-server"]
CMD ["--host=0.0.0.0", "--port=50062"]
