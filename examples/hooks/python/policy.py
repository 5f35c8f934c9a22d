"""policy: keeps dangerous tools away from the model.

  model_request      narrows active_tools to the offered tools minus the
                     denied ones, so the model is not even offered them
  invalid_tool_call  a model that calls a hidden tool anyway: hookwire treats
                     it as an unknown tool (it never runs); the policy
                     answers skip with the same error result as below
  tool_call          denied tool -> skip with an error result the model reads;
                     tool that needs approval -> ask (the client approves or not)

Narrowing the offer is the first line; the tool_call check still matters
because a synthetic `respond` or another agent's config can still produce a
call to an offered but denied tool.
"""

from __future__ import annotations

import json

from hookproto import pb
from hooklib import Feature, RunState, ev, verdict

# Scratchpad key shared with the other hooks of the run (and later events):
# a JSON list of the tool names this policy denied so far.
DENIED_KEY = "policy.denied_tools"


class Policy(Feature):
    name = "policy"
    events = frozenset({ev("model_request"), ev("invalid_tool_call"), ev("tool_call")})

    def __init__(self, deny: set[str], ask: set[str], deny_for: dict[str, set[str]] | None = None):
        self.deny = deny
        self.ask = ask - deny  # deny wins over ask
        # Per tenant: tools denied only to these principals (EventContext.principal,
        # the caller hookwire authenticated).
        self.deny_for = deny_for or {}

    def denied(self, event: pb.HookEvent) -> set[str]:
        return self.deny | self.deny_for.get(event.context.principal, set())

    async def on_event(self, event: pb.HookEvent, run: RunState) -> pb.HookVerdict | None:
        payload = event.WhichOneof("payload")
        if payload == "model_request":
            return self._narrow(event, run)
        if payload == "tool_call":
            return self._check_call(event, run)
        if payload == "invalid_tool_call":
            return self._check_call(event, run)
        return None

    def _narrow(self, event: pb.HookEvent, run: RunState) -> pb.HookVerdict | None:
        request = event.model_request.request
        offered = [t.name for t in request.tools]
        # Only names that were offered: an unknown name in active_tools makes
        # the whole verdict invalid (a hook failure).
        deny = self.denied(event)
        allowed = [name for name in offered if name not in deny]
        if len(allowed) == len(offered):
            return None
        patch = pb.RequestPatch(active_tools=pb.ToolNames(names=allowed))
        # Keep the effective request valid: hookwire refuses to call the model
        # when tool_choice names a tool that is no longer active, or requires
        # a tool call with no tool left, and blames the hook whose patch did it.
        choice = request.tool_choice
        Mode = pb.ToolChoice.Mode
        if (choice.mode == Mode.Value("MODE_TOOL") and choice.tool_name in deny) or (
            choice.mode == Mode.Value("MODE_REQUIRED") and not allowed
        ):
            fallback = "MODE_AUTO" if allowed else "MODE_NONE"
            patch.tool_choice.CopyFrom(pb.ToolChoice(mode=Mode.Value(fallback)))
        run.notes["narrowed"] += 1
        hidden = sorted(set(offered) - set(allowed))
        return verdict(
            event,
            pb.ModelRequestVerdict(patch_request=patch),
            reason=f"hid denied tools: {', '.join(hidden)}",
        )

    def _check_call(self, event: pb.HookEvent, run: RunState) -> pb.HookVerdict | None:
        invalid = event.WhichOneof("payload") == "invalid_tool_call"
        call = event.invalid_tool_call.call if invalid else event.tool_call.call
        if call.name in self.denied(event):
            run.notes["denied"] += 1
            # Read the list from the event's scratchpad (it is the run's, shared
            # by every hook) rather than from local state, and write it back.
            denied = json.loads(event.context.scratchpad.get(DENIED_KEY, b"[]"))
            if call.name not in denied:
                denied.append(call.name)
            skip = pb.Skip(
                result=f"The tool {call.name!r} is not allowed by policy. "
                "Do not call it again; answer without it.",
                is_error=True,
            )
            action = (
                pb.InvalidToolCallVerdict(skip=skip) if invalid else pb.ToolCallVerdict(skip=skip)
            )
            return verdict(
                event,
                action,
                reason=f"tool {call.name} is denied by policy",
                scratchpad=[pb.ScratchpadUpdate(key=DENIED_KEY, set=json.dumps(denied).encode())],
            )
        if invalid:
            return None  # hookwire's default error result for the model
        if call.name in self.ask:
            run.notes["asked"] += 1
            args = call.arguments_json
            if len(args) > 200:
                args = args[:200] + "..."
            return verdict(
                event,
                pb.ToolCallVerdict(
                    # timeout_ms 0: hookwire's configured approval timeout.
                    ask=pb.Ask(question=f"Allow the agent to call {call.name} with {args}?")
                ),
                reason=f"tool {call.name} needs approval",
            )
        return None
