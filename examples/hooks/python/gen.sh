#!/bin/sh
# Regenerate the Python stubs into ./generated/ (server.py also does this by
# itself when they are missing or older than the .proto files).
set -eu
cd "$(dirname "$0")"
exec python3 hookproto.py
