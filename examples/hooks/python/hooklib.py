"""Small helpers shared by the example features: verdict builders, per-run
state and the Feature interface. Nothing here is hookwire-specific magic; it
only saves each feature from repeating protocol boilerplate."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from hookproto import common, pb


def event_name(kind: int) -> str:
    """EVENT_KIND_TOOL_CALL -> "tool_call": the snake_case name hookwire uses
    everywhere, which is also the name of the HookEvent payload field and of
    the matching HookVerdict verdict field.

    Enums only grow: a kind newer than these stubs is named by its number
    ("event_kind_12") instead of raising, so logging or counting it never
    breaks the stream. (hookwire sends only the kinds listed in Describe.)"""
    if kind not in common.EventKind.values():
        return f"event_kind_{kind}"
    return common.EventKind.Name(kind).removeprefix("EVENT_KIND_").lower()


def ev(name: str) -> int:
    """"tool_call" -> EVENT_KIND_TOOL_CALL."""
    return common.EventKind.Value("EVENT_KIND_" + name.upper())


# The verdict message of every event that can be answered. Observe events
# (text_delta, run_end, session_end) have none: they are never answered.
VERDICT_TYPES = {
    "session_start": pb.SessionStartVerdict,
    "run_start": pb.RunStartVerdict,
    "model_request": pb.ModelRequestVerdict,
    "model_response": pb.ModelResponseVerdict,
    "invalid_tool_call": pb.InvalidToolCallVerdict,
    "tool_call": pb.ToolCallVerdict,
    "tool_result": pb.ToolResultVerdict,
    "turn_end": pb.TurnEndVerdict,
}


def verdict(event: pb.HookEvent, action, **meta) -> pb.HookVerdict:
    """Answer `event` with `action` (e.g. pb.ToolCallVerdict(skip=...)).

    The verdict field is chosen from the event kind, so echoing the seq and
    picking the right oneof field cannot go wrong; passing an action of the
    wrong type raises TypeError here instead of being a wrong_kind hook
    failure in hookwire. `meta` takes reason, scratchpad, telemetry_redaction.
    """
    return pb.HookVerdict(seq=event.seq, **{event_name(event.kind): action}, **meta)


def proceed(event: pb.HookEvent, reason: str = "") -> pb.HookVerdict:
    """"continue" for any blocking event (spelled `proceed` in the proto
    because `continue` is a keyword in most languages)."""
    action = VERDICT_TYPES[event_name(event.kind)](proceed=pb.Continue())
    return verdict(event, action, reason=reason)


@dataclass
class RunState:
    """State of one run, owned by its Process stream handler.

    hookwire opens one stream per run, so anything kept here is naturally
    scoped to the run and needs no locking or cleanup: it is dropped when the
    stream ends. (Use the scratchpad instead for facts that other hooks or
    hookwire itself should see.)
    """

    traceparent: str = ""  # from the stream metadata: the run's trace
    run_id: str = ""
    session_id: str = ""
    agent: str = ""
    # The caller hookwire authenticated ("anonymous" when its auth is off):
    # decide per tenant on it, never on anything the model wrote.
    principal: str = ""
    outcome: str = ""  # from run_end, when subscribed
    started: float = field(default_factory=time.monotonic)
    events: Counter = field(default_factory=Counter)  # event name -> count
    notes: Counter = field(default_factory=Counter)  # what the features did

    def record(self, event: pb.HookEvent) -> None:
        if not self.run_id:
            self.run_id = event.context.run_id
            self.session_id = event.context.session_id
            self.agent = event.context.agent
            self.principal = event.context.principal
        self.events[event_name(event.kind)] += 1

    def summary(self) -> str:
        events = ", ".join(f"{k}={v}" for k, v in sorted(self.events.items()))
        notes = ", ".join(f"{k}={v}" for k, v in sorted(self.notes.items())) or "nothing"
        took = time.monotonic() - self.started
        return (f"run {self.run_id} ({self.agent}, principal {self.principal or '-'}) in {took:.2f}s; "
                f"events: {events}; did: {notes}")


class Feature:
    """One piece of hook behaviour. The server asks each enabled feature, in
    order, about each event it subscribes to; the first verdict wins and no
    answer at all means continue."""

    name = "feature"
    events: frozenset[int] = frozenset()

    def tools(self) -> list[common.ToolSpec]:
        """Tools this feature owns (advertised in Describe)."""
        return []

    def owns(self, tool_name: str) -> bool:
        return any(t.name == tool_name for t in self.tools())

    async def on_event(self, event: pb.HookEvent, run: RunState) -> pb.HookVerdict | None:
        """A verdict for a blocking event, or None for "no opinion"."""
        return None

    async def call_tool(self, request: pb.CallToolRequest) -> pb.CallToolResponse:
        raise NotImplementedError
