#!/usr/bin/env python3
"""Self-test of the example server: starts server.py as a real process on
port 0 and drives it the way hookwire does (Describe, one Process stream per
run, CallTool, health), asserting every verdict.

    python3 selftest.py        # exit 0 and "selftest: N passed, 0 failed"

Copy the pattern to test your own hook server before pointing hookwire at it.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hookproto import common, pb, pb_grpc
from hooklib import ev

HERE = Path(__file__).resolve().parent
# The slow server's time per decision: long enough that a server ignoring
# its deadline, or deciding one event after the other, cannot pass the
# timing checks below by luck, and no load can fail a correct one.
LATENCY_S = 3.0


class CheckFailed(Exception):
    """A check that did not hold."""


def require(condition, message=None) -> None:
    """An explicit check. Unlike `assert`, it is not stripped when Python
    runs with -O (PYTHONOPTIMIZE), which would turn every check into a pass."""
    if not condition:
        if message is None:
            message = traceback.extract_stack(limit=2)[0].line
        raise CheckFailed(message)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SECRET_INPUT = "I am bob@example.com, my key is sk-test-ABCDEF123456 and SECRET-HUNTER2 is the password"


class Server:
    """server.py in a subprocess on a free port."""

    def __init__(self, *flags: str):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "server.py"), "--port", "0", *flags],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        line = self.proc.stdout.readline()  # blocks until bound (or exited)
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"server did not start: {line!r}\n{self.logs()}")
        self.port = int(line.split()[-1])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.HookServiceStub(self.channel)

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Run:
    """One Process stream, driven event by event like hookwire does.

    Requests come from a queue, so the first event is already queued when the
    call starts (a Python server sends its response headers only with its
    first verdict: a client that waits for headers before sending would hang).
    """

    END = object()

    def __init__(self, server: Server, run_id: str = "r-1"):
        self.run_id = run_id
        self.requests: queue.Queue = queue.Queue()
        self.verdicts: queue.Queue = queue.Queue()
        self.call = server.stub.Process(
            iter(self.requests.get, None), metadata=[("traceparent", TRACEPARENT)]
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for verdict in self.call:
                self.verdicts.put(verdict)
            self.verdicts.put(self.END)
        except grpc.RpcError as e:
            self.verdicts.put(e)

    def send(self, seq: int, kind: str, payload, *, expects: bool = True,
             deadline_ms: int = 5000, turn: int = 1, scratchpad: dict | None = None) -> None:
        context = pb.EventContext(
            session_id="s-1", run_id=self.run_id, turn=turn, agent="demo", streaming=True,
            scratchpad=scratchpad or {}, deadline_remaining_ms=deadline_ms, traceparent=TRACEPARENT,
        )
        self.requests.put(pb.HookEvent(seq=seq, kind=ev(kind), context=context,
                                       expects_verdict=expects, **{kind: payload}))

    def recv(self, seq: int, kind: str, timeout: float = 10) -> pb.HookVerdict:
        """The next verdict; it must answer `seq` with a `kind` verdict."""
        got = self.verdicts.get(timeout=timeout)
        require(isinstance(got, pb.HookVerdict), f"expected verdict for seq {seq}, stream ended: {got}")
        require(got.seq == seq, f"expected seq {seq}, got {got.seq}")
        require(got.WhichOneof("verdict") == kind, f"seq {seq}: verdict kind {got.WhichOneof('verdict')}")
        return got

    def ask(self, seq: int, kind: str, payload, **kw) -> tuple[str, object, pb.HookVerdict]:
        """Send one blocking event, return (action name, action, verdict)."""
        self.send(seq, kind, payload, **kw)
        v = self.recv(seq, kind)
        typed = getattr(v, kind)
        action = typed.WhichOneof("action")
        return action, getattr(typed, action), v

    def close(self) -> None:
        """Half-close like hookwire after run_end; the server must end the
        stream cleanly without sending anything else."""
        self.requests.put(None)
        got = self.verdicts.get(timeout=10)
        require(got is self.END, f"expected clean end of stream, got {got}")
        require(self.call.code() == grpc.StatusCode.OK, self.call.code())


def tool(name: str, schema: dict | None = None) -> common.ToolSpec:
    return common.ToolSpec(name=name, description=f"{name} tool",
                           parameters_json_schema=json.dumps(schema or {"type": "object"}))


def call(call_id: str, name: str, args: dict) -> common.ToolCall:
    return common.ToolCall(id=call_id, name=name, arguments_json=json.dumps(args))


def text(t: str) -> common.Block:
    return common.Block(text=common.TextBlock(text=t))


def no_secrets(s: str) -> None:
    for needle in ("bob@example.com", "ada@example.com", "sk-test-", "SECRET-"):
        require(needle not in s, f"{needle!r} leaked in {s!r}")


# ---------------------------------------------------------------- checks

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def health_is_serving(s: dict) -> None:
    stub = health_pb2_grpc.HealthStub(s["all"].channel)
    for service in ("", "hookwire.v1.HookService"):
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        require(status == health_pb2.HealthCheckResponse.SERVING, (service, status))


@check
def describe_lists_events_and_tools(s: dict) -> None:
    d = s["all"].stub.Describe(pb.DescribeRequest(hookwire_version="test"), timeout=5)
    require(d.name == "hookwire-example-python" and d.version, d)
    want = {ev(k) for k in ("run_start", "model_request", "model_response", "invalid_tool_call",
                            "tool_call", "tool_result")}
    require(set(d.events) == want, d.events)
    require([t.name for t in d.tools] == ["get_weather", "lookup_customer"], d.tools)
    for t in d.tools:
        require(json.loads(t.parameters_json_schema)["type"] == "object" and t.description)
    only_redactor = s["slow"].stub.Describe(pb.DescribeRequest(), timeout=5)
    require(set(only_redactor.events) == {ev(k) for k in ("run_start", "model_response", "tool_result")})
    require(not only_redactor.tools)


@check
def full_run(s: dict) -> None:
    """A realistic run: every verdict checked for seq, kind and content."""
    r = Run(s["all"])
    action, a, v = r.ask(1, "run_start", pb.RunStartEvent(input=SECRET_INPUT), turn=0)
    require(action == "rewrite_input", action)
    require("[REDACTED:email]" in a.input and "[REDACTED:api_key]" in a.input and "[REDACTED:secret]" in a.input)
    no_secrets(a.input)
    require(v.HasField("telemetry_redaction") and v.telemetry_redaction == a.input)
    no_secrets(v.reason)

    offered = ["get_weather", "lookup_customer", "shell", "send_email", "delete_file"]
    request = pb.ModelRequest(model="scripted", tools=[tool(n) for n in offered])
    action, a, v = r.ask(2, "model_request", pb.ModelRequestEvent(request=request))
    require(action == "patch_request", action)
    require(a.HasField("active_tools") and list(a.active_tools.names) == ["get_weather", "lookup_customer", "send_email"])
    require(not a.HasField("tool_choice"))  # auto stays auto

    # Observe events are not answered: the next verdict must be seq 4's.
    r.send(3, "text_delta", pb.TextDeltaEvent(text="Let me "), expects=False)
    calls = [call("c1", "get_weather", {"city": "Paris"}), call("c2", "shell", {"cmd": "rm -rf /"}),
             call("c3", "send_email", {"to": "bob@example.com"}), call("c4", "lookup_customer", {"id": "C-1001"})]
    message = common.Message(role=common.ROLE_ASSISTANT,
                             blocks=[text("Let me check.")] + [common.Block(tool_call=c) for c in calls])
    action, _, _ = r.ask(4, "model_response", pb.ModelResponseEvent(
        response=pb.ModelResponse(message=message, finish_reason="tool_calls")))
    require(action == "proceed", action)

    action, _, _ = r.ask(5, "tool_call", pb.ToolCallEvent(call=calls[0], call_index=0, tool=tool("get_weather")))
    require(action == "proceed", action)
    action, a, v = r.ask(6, "tool_call", pb.ToolCallEvent(call=calls[1], call_index=1, tool=tool("shell")))
    require(action == "skip" and a.is_error and "not allowed" in a.result, a)
    require("denied" in v.reason)
    require([(u.key, json.loads(u.set)) for u in v.scratchpad] == [("policy.denied_tools", ["shell"])])
    action, a, _ = r.ask(7, "tool_call", pb.ToolCallEvent(call=calls[2], call_index=2, tool=tool("send_email")),
                         scratchpad={"policy.denied_tools": b'["shell"]'})
    require(action == "ask" and "send_email" in a.question, a)

    result = common.ToolResultBlock(call_id="c1", name="get_weather", content="sunny, 21C in Paris")
    action, _, _ = r.ask(8, "tool_result", pb.ToolResultEvent(call=calls[0], call_index=0, result=result))
    require(action == "proceed", action)
    record = json.dumps({"email": "ada@example.com", "api_token": "SECRET-7F3KQ9ZX"})
    result = common.ToolResultBlock(call_id="c4", name="lookup_customer", content=record)
    action, a, v = r.ask(9, "tool_result", pb.ToolResultEvent(call=calls[3], call_index=3, result=result))
    require(action == "rewrite_result" and not a.HasField("is_error"), a)
    no_secrets(a.content)
    require(json.loads(a.content)["email"] == "[REDACTED:email]")
    require(v.telemetry_redaction == a.content)

    final = common.Message(role=common.ROLE_ASSISTANT, blocks=[
        common.Block(reasoning=common.ReasoningBlock(text="token is SECRET-7F3KQ9ZX")),
        text("Ada (ada@example.com) is on the pro plan."),
    ])
    action, a, v = r.ask(10, "model_response", pb.ModelResponseEvent(
        response=pb.ModelResponse(message=final, finish_reason="stop")), turn=2)
    require(action == "rewrite_response", action)
    require([b.WhichOneof("kind") for b in a.blocks] == ["reasoning", "text"])
    for b in a.blocks:
        no_secrets(getattr(b, b.WhichOneof("kind")).text)
    require(v.telemetry_redaction == "Ada ([REDACTED:email]) is on the pro plan.")

    action, _, _ = r.ask(11, "turn_end", pb.TurnEndEvent(message=final), turn=2)
    require(action == "proceed", action)
    r.send(12, "run_end", pb.RunEndEvent(outcome=common.RUN_OUTCOME_COMPLETED, turns=2), expects=False)
    r.close()
    require("events: model_request=1, model_response=2, run_end=1" in s["all"].logs())


@check
def scratchpad_accumulates_denied_tools(s: dict) -> None:
    r = Run(s["all"], "r-scratch")
    c = call("c9", "delete_file", {"path": "/etc/passwd"})
    _, _, v = r.ask(1, "tool_call", pb.ToolCallEvent(call=c, tool=tool("delete_file")),
                    scratchpad={"policy.denied_tools": b'["shell"]'})
    require(json.loads(v.scratchpad[0].set) == ["shell", "delete_file"], v.scratchpad)
    r.close()


@check
def hidden_tool_called_anyway_is_skipped(s: dict) -> None:
    """A call to a tool the policy hid reaches it as invalid_tool_call
    (hookwire never runs it): denied -> skip with the policy's message;
    any other unknown tool -> hookwire's default error result."""
    r = Run(s["all"], "r-hidden")
    c = call("c1", "shell", {"cmd": "ls"})
    action, a, v = r.ask(1, "invalid_tool_call", pb.InvalidToolCallEvent(
        call=c, problem=pb.InvalidToolCallEvent.PROBLEM_UNKNOWN_TOOL, error="unknown tool `shell`"))
    require(action == "skip" and a.is_error and "not allowed by policy" in a.result, a)
    require("denied" in v.reason, v.reason)
    c = call("c2", "no_such_tool", {})
    action, _, _ = r.ask(2, "invalid_tool_call", pb.InvalidToolCallEvent(
        call=c, problem=pb.InvalidToolCallEvent.PROBLEM_UNKNOWN_TOOL, error="unknown tool `no_such_tool`"))
    require(action == "proceed", action)
    r.close()


@check
def tool_choice_kept_valid(s: dict) -> None:
    r = Run(s["all"], "r-choice")
    forced = pb.ModelRequest(tools=[tool("shell"), tool("get_weather")],
                             tool_choice=pb.ToolChoice(mode=pb.ToolChoice.MODE_TOOL, tool_name="shell"))
    action, a, _ = r.ask(1, "model_request", pb.ModelRequestEvent(request=forced))
    require(action == "patch_request" and list(a.active_tools.names) == ["get_weather"])
    require(a.HasField("tool_choice") and a.tool_choice.mode == pb.ToolChoice.MODE_AUTO, a)
    required = pb.ModelRequest(tools=[tool("shell")], tool_choice=pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED))
    action, a, _ = r.ask(2, "model_request", pb.ModelRequestEvent(request=required))
    require(a.HasField("active_tools") and list(a.active_tools.names) == [], a)  # set and empty: no tools
    require(a.tool_choice.mode == pb.ToolChoice.MODE_NONE, a)
    clean = pb.ModelRequest(tools=[tool("get_weather")])
    action, _, _ = r.ask(3, "model_request", pb.ModelRequestEvent(request=clean))
    require(action == "proceed", action)
    r.close()


@check
def observe_mode_events_are_not_answered(s: dict) -> None:
    """A hook configured with mode: observe gets expects_verdict=false even
    on blocking events; it must stay silent."""
    r = Run(s["all"], "r-observe")
    c = call("c1", "shell", {"cmd": "ls"})
    r.send(1, "tool_call", pb.ToolCallEvent(call=c, tool=tool("shell")), expects=False)
    r.send(2, "run_start", pb.RunStartEvent(input=SECRET_INPUT), expects=False)
    action, _, _ = r.ask(3, "turn_end", pb.TurnEndEvent())
    require(action == "proceed")
    r.send(4, "run_end", pb.RunEndEvent(outcome=common.RUN_OUTCOME_COMPLETED), expects=False)
    r.close()


@check
def gives_up_before_the_deadline(s: dict) -> None:
    """The slow server needs LATENCY_S per decision; with 400 ms left it
    must answer continue in time (it keeps a 40 ms margin) instead of late."""
    r = Run(s["slow"], "r-deadline")
    start = time.monotonic()
    action, _, v = r.ask(1, "run_start", pb.RunStartEvent(input=SECRET_INPUT), deadline_ms=400)
    took = time.monotonic() - start
    require(action == "proceed" and "out of time" in v.reason, v)
    # It gave up rather than deciding: well under the time a decision takes.
    require(took < LATENCY_S, f"answered after {took:.3f}s: it did the {LATENCY_S}s of work")
    r.close()


@check
def decides_events_concurrently(s: dict) -> None:
    """Two events in flight on one stream (e.g. tool_concurrency > 1) are
    decided in parallel and answered by seq, whatever the order."""
    r = Run(s["slow"], "r-concurrent")
    start = time.monotonic()
    for seq in (1, 2):
        result = common.ToolResultBlock(call_id=f"c{seq}", content="mail ada@example.com")
        r.send(seq, "tool_result", pb.ToolResultEvent(result=result, call_index=seq - 1))
    got = sorted([r.verdicts.get(timeout=10), r.verdicts.get(timeout=10)], key=lambda v: v.seq)
    took = time.monotonic() - start
    require([v.seq for v in got] == [1, 2], got)
    require(all(v.tool_result.WhichOneof("action") == "proceed" for v in got))  # telemetry mode
    require(all(v.telemetry_redaction == "mail [REDACTED:email]" for v in got), got)
    # One after the other would take two decisions' time at least.
    require(took < 2 * LATENCY_S, f"took {took:.2f}s: decisions ran one after the other")
    r.close()


@check
def a_long_run_of_token_text_is_redacted_within_its_deadline(s: dict) -> None:
    """100 KB of base64-like text without an "@" (a token in a tool result):
    the e-mail pattern tried every position of it, quadratic, for seconds on
    the event loop, past this event's deadline and every other stream's."""
    r = Run(s["all"], "r-long")
    token = "QWxhZGRpbjpvcGVuIHNlc2FtZQ" * 4000
    result = common.ToolResultBlock(call_id="c1", content=f"token {token} for ada@example.com")
    start = time.monotonic()
    r.send(1, "tool_result", pb.ToolResultEvent(result=result, call_index=0), deadline_ms=2000)
    v = r.recv(1, "tool_result", timeout=30)
    took = time.monotonic() - start
    require(took < 2.0, f"took {took:.2f}s, past the event's 2 s deadline")
    require(v.tool_result.WhichOneof("action") == "rewrite_result", v)
    require(v.tool_result.rewrite_result.content.endswith("for [REDACTED:email]"))
    r.close()


@check
def telemetry_only_mode(s: dict) -> None:
    r = Run(s["slow"], "r-telemetry")
    action, _, v = r.ask(1, "run_start", pb.RunStartEvent(input=SECRET_INPUT), deadline_ms=10_000)
    require(action == "proceed", action)  # the run keeps the real input
    no_secrets(v.telemetry_redaction)
    r.close()


@check
def call_tool(s: dict) -> None:
    stub = s["all"].stub

    def run(name: str, args) -> pb.CallToolResponse:
        raw = args if isinstance(args, str) else json.dumps(args)
        request = pb.CallToolRequest(context=pb.EventContext(run_id="r-1", deadline_remaining_ms=5000),
                                     call=common.ToolCall(id="c1", name=name, arguments_json=raw))
        return stub.CallTool(request, timeout=5)

    require(run("get_weather", {"city": "Paris"}) == pb.CallToolResponse(content="sunny, 21C in Paris"))
    require(run("get_weather", {"city": "Paris", "unit": "F"}).content == "sunny, 70F in Paris")
    require(run("get_weather", {"city": "Reykjavik"}) == run("get_weather", {"city": "Reykjavik"}))
    for bad in ({}, {"city": 5}, {"city": ""}, {"city": "Paris", "unit": "K"}, {"city": "x", "extra": 1}, "{not json", "[]"):
        r = run("get_weather", bad)
        require(r.is_error, (bad, r))
    r = run("lookup_customer", {"id": "C-1001"})
    require(not r.is_error and "SECRET-" in r.content and json.loads(r.content)["email"] == "ada@example.com")
    for bad in ({"id": "C-9999"}, {"id": "1001"}, {"id": 1001}):
        r = run("lookup_customer", bad)
        require(r.is_error, (bad, r))
    try:
        run("no_such_tool", {})
        raise AssertionError("unknown tool accepted")
    except grpc.RpcError as e:
        require(e.code() == grpc.StatusCode.NOT_FOUND, e)


def main() -> int:
    started = time.monotonic()
    servers, passed, failed = {}, 0, 0
    try:
        servers["all"] = Server()
        servers["slow"] = Server("--features", "redactor", "--redactor-mode", "telemetry",
                                 "--simulate-latency-ms", str(int(LATENCY_S * 1000)))
        for fn in CHECKS:
            t = time.monotonic()
            try:
                fn(servers)
                passed += 1
                print(f"ok   {fn.__name__} ({(time.monotonic() - t) * 1000:.0f} ms)")
            except Exception:
                failed += 1
                print(f"FAIL {fn.__name__}\n{traceback.format_exc()}")
        if failed:
            for name, srv in servers.items():
                print(f"--- server {name} log ---\n{srv.logs()}")
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"({time.monotonic() - started:.1f}s)")
    print(f"selftest: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    os.chdir(HERE)
    sys.exit(main())
