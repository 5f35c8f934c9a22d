#!/usr/bin/env bash
# `make demo`: starts the Python example hook server and hookwire (scripted
# model, examples/demo/hookwire.yaml) on free ports, then runs one session
# through the CLI. The timeline shows the redactor masking an API key, the
# policy denying a tool, and a tool executed by the remote hook server.
# Everything started here is stopped on exit, however the script ends.
#
# Needs: the Python example's packages (`make deps` puts them in .venv/).
# HOOKWIRE_BIN=path skips the cargo build (the test suite uses it).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PYTHON=${PYTHON:-python3}
CONFIG=examples/demo/hookwire.yaml
PROMPT="My API key is sk-live-4f9a8b7c6d5e4f3a. What's the weather in Paris? And look up customer C-1001 for me."

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# wait_for FILE TEXT PID: until FILE contains TEXT (30 s at most), failing
# early with PID's log when the process died.
wait_for() {
    for _ in $(seq 300); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        if ! kill -0 "$3" 2>/dev/null; then
            echo "demo: process $3 exited early; its output:" >&2
            cat "$work"/*.log "$1" >&2 || true
            exit 1
        fi
        sleep 0.1
    done
    echo "demo: timed out waiting for '$2' in $1" >&2
    cat "$work"/*.log >&2 || true
    exit 1
}

if [ -n "${HOOKWIRE_BIN:-}" ]; then
    hookwire=$HOOKWIRE_BIN
else
    ${CARGO:-cargo} build --quiet --bin hookwire
    hookwire=${CARGO_TARGET_DIR:-target}/debug/hookwire
fi

echo "── hookwire config check $CONFIG"
"$hookwire" config check "$CONFIG"

"$PYTHON" examples/hooks/python/server.py --port 0 --deny lookup_customer \
    >"$work/hook.out" 2>"$work/hook.log" &
pids+=($!)
wait_for "$work/hook.out" "^listening on " "${pids[-1]}"
port=$(sed -n 's/^listening on //p' "$work/hook.out")
echo "── Python hook server (redactor, policy --deny lookup_customer, tools) on 127.0.0.1:$port"

# The same config, pointed at the port the hook server got.
sed "s#http://127.0.0.1:50061#http://127.0.0.1:$port#" "$CONFIG" >"$work/hookwire.yaml"
"$hookwire" serve --config "$work/hookwire.yaml" --data-dir "$work" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
    >"$work/hookwire.log" 2>&1 &
pids+=($!)
wait_for "$work/hookwire.log" "hookwire serving" "${pids[-1]}"
addr=http://$(sed -n 's/.*listening grpc=\([0-9.:]*\).*/\1/p' "$work/hookwire.log" | head -n 1)
echo "── hookwire serving on $addr"
echo

echo "── hookwire hooks list"
"$hookwire" hooks list --addr "$addr"
echo
echo "── hookwire run --agent support \"$PROMPT\""
"$hookwire" run --addr "$addr" --agent support "$PROMPT"
echo
cat <<'EOF'
── what happened
  ⚑ run_start · rewrite_input        the redactor masked the API key before it entered history
  ⚑ model_request · patch_request    the policy hid lookup_customer from the model
  ⚙ executing get_weather            hookwire called CallTool on the Python hook server
  ⚑ invalid_tool_call · skip         the model called the hidden lookup_customer anyway: hookwire never ran it, the policy answered
EOF
