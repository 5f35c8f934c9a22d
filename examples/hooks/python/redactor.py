"""redactor: masks e-mail addresses, API keys and secrets before the model, the
client, the transcript or telemetry see them.

Where it acts:
  run_start       the user's input           -> rewrite_input
  tool_result     a tool's output            -> rewrite_result
  model_response  the model's text/reasoning -> rewrite_response

Every verdict that redacts also sets telemetry_redaction, so spans record the
masked text. With mode "telemetry" it only does that: the run keeps the real
values (the model may need them) and only telemetry is masked.
"""

from __future__ import annotations

import re
from collections import Counter

from hookproto import common, pb
from hooklib import Feature, RunState, ev, verdict

# Kinds of sensitive text, in the order they are applied. Patterns are meant
# to be obvious, not complete: a real deployment tunes them.
#
# The e-mail pattern starts only where a run of name characters starts and
# reads at most 64 of them (an address's local part): unanchored, it tried
# every position of a long run without an "@" (a token, base64, hex), which
# is quadratic - 40 KB of it took seconds, and redact() runs on the event
# loop, stalling every stream of the server past its deadlines.
PATTERNS = {
    "email": re.compile(
        r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
    ),
    "api_key": re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"),
    "secret": re.compile(r"\bSECRET-\w+"),
}


def redact(text: str) -> tuple[str, Counter]:
    """The masked text and how many of each kind were masked."""
    found: Counter = Counter()
    for kind, pattern in PATTERNS.items():
        text, n = pattern.subn(f"[REDACTED:{kind}]", text)
        if n:
            found[kind] += n
    return text, found


def describe(found: Counter) -> str:
    # Counts only: a reason is recorded in provenance and spans, so it must
    # never quote what was masked.
    return "redacted " + ", ".join(f"{n} {kind}" for kind, n in sorted(found.items()))


class Redactor(Feature):
    name = "redactor"
    events = frozenset({ev("run_start"), ev("tool_result"), ev("model_response")})

    def __init__(self, mode: str = "rewrite"):
        if mode not in ("rewrite", "telemetry"):
            raise ValueError(f"redactor mode must be rewrite or telemetry, not {mode!r}")
        self.rewrite = mode == "rewrite"

    async def on_event(self, event: pb.HookEvent, run: RunState) -> pb.HookVerdict | None:
        payload = event.WhichOneof("payload")
        if payload == "run_start":
            masked, found = redact(event.run_start.input)
            action = pb.RunStartVerdict(rewrite_input=pb.RewriteInput(input=masked))
        elif payload == "tool_result":
            masked, found = redact(event.tool_result.result.content)
            # is_error left unset: the tool's own error flag stands.
            action = pb.ToolResultVerdict(rewrite_result=pb.RewriteResult(content=masked))
        elif payload == "model_response":
            blocks, found = self._redact_blocks(event.model_response.response.message.blocks)
            masked = "\n".join(b.text.text for b in blocks if b.HasField("text"))
            action = pb.ModelResponseVerdict(rewrite_response=pb.RewriteResponse(blocks=blocks))
        else:
            return None
        if not found:
            return None  # nothing to hide: continue
        run.notes["redactions"] += sum(found.values())
        if not self.rewrite:
            action = type(action)(proceed=pb.Continue())
        return verdict(event, action, reason=describe(found), telemetry_redaction=masked)

    @staticmethod
    def _redact_blocks(blocks) -> tuple[list[common.Block], Counter]:
        """A copy of the assistant message with text and reasoning masked.

        rewrite_response replaces the whole message, so every block is copied,
        including tool calls. Tool-call arguments are left alone on purpose:
        masking them would change what the tool does (a send_email call needs
        its address); guard tools with tool_call hooks instead.
        """
        out, found = [], Counter()
        for block in blocks:
            copy = common.Block()
            copy.CopyFrom(block)
            block = copy
            kind = block.WhichOneof("kind")
            if kind in ("text", "reasoning"):
                part = getattr(block, kind)
                part.text, n = redact(part.text)
                found += n
            out.append(block)
        return out, found
