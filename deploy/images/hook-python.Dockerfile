# syntax=docker/dockerfile:1
# The Python example hook server (examples/hooks/python). From the repository root:
#   docker build -f deploy/images/hook-python.Dockerfile -t hookwire-example-python:0.1.0 .
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOOKWIRE_PROTO_DIR=/app/proto

WORKDIR /app/hook
COPY examples/hooks/python/requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt

COPY proto /app/proto
COPY examples/hooks/python/ .
# Generate the stubs now: the pod's root filesystem is read-only, and the
# server only regenerates them when the .proto files are newer.
RUN python3 hookproto.py

USER 65532:65532
EXPOSE 50061
ENTRYPOINT ["python3", "server.py"]
CMD ["--host", "0.0.0.0", "--port", "50061"]
