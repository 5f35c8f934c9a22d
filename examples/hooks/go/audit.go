package main

import (
	"encoding/json"
	"os"
	"sort"
	"sync"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	pb "hookwire.example/gen/hookwirev1"
)

// Audit appends one JSON object per event to a file (JSON Lines).
//
// By default a line holds facts about the event (ids, kind, tool names,
// sizes, outcome), not its content: an audit trail should not become a second
// copy of the secrets a redactor hook keeps out of telemetry. --audit-content
// adds the full payload for debugging.
type Audit struct {
	mu      sync.Mutex // runs are concurrent streams; keep lines whole
	f       *os.File
	content bool
}

func OpenAudit(path string, content bool) (*Audit, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	return &Audit{f: f, content: content}, nil
}

func (a *Audit) Close() error { return a.f.Close() }

type auditLine struct {
	Time           string          `json:"time"`
	Event          string          `json:"event"`
	Seq            uint64          `json:"seq"`
	SessionID      string          `json:"session_id"`
	RunID          string          `json:"run_id,omitempty"`
	Agent          string          `json:"agent,omitempty"`
	Principal      string          `json:"principal,omitempty"` // the caller hookwire authenticated
	Turn           uint32          `json:"turn"`
	ExpectsVerdict bool            `json:"expects_verdict"`
	DeadlineMs     uint64          `json:"deadline_remaining_ms,omitempty"`
	Traceparent    string          `json:"traceparent,omitempty"`
	RunEventsSeen  int             `json:"run_events_seen"` // from the stream's per-run state
	ScratchpadKeys []string        `json:"scratchpad_keys,omitempty"`
	Detail         map[string]any  `json:"detail,omitempty"`
	Payload        json.RawMessage `json:"payload,omitempty"`
}

// Write records one event. One Write call per line on an O_APPEND file, so
// lines from concurrent runs never interleave.
func (a *Audit) Write(ev *pb.HookEvent, run *runState) error {
	ctx := ev.GetContext()
	line := auditLine{
		Time:           time.Now().UTC().Format(time.RFC3339Nano),
		Event:          eventName(ev.Kind),
		Seq:            ev.Seq,
		SessionID:      ctx.GetSessionId(),
		RunID:          ctx.GetRunId(),
		Agent:          ctx.GetAgent(),
		Principal:      ctx.GetPrincipal(),
		Turn:           ctx.GetTurn(),
		ExpectsVerdict: ev.ExpectsVerdict,
		DeadlineMs:     ctx.GetDeadlineRemainingMs(),
		Traceparent:    run.traceparent,
		RunEventsSeen:  run.eventsSeen,
		Detail:         detail(ev),
	}
	if line.Traceparent == "" {
		line.Traceparent = ctx.GetTraceparent()
	}
	for k := range ctx.GetScratchpad() {
		line.ScratchpadKeys = append(line.ScratchpadKeys, k)
	}
	sort.Strings(line.ScratchpadKeys)
	if a.content {
		payload, err := protojson.Marshal(ev)
		if err != nil {
			return err
		}
		line.Payload = payload
	}
	b, err := json.Marshal(line)
	if err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	_, err = a.f.Write(append(b, '\n'))
	return err
}

// detail summarises an event without its content.
func detail(ev *pb.HookEvent) map[string]any {
	switch p := ev.Payload.(type) {
	case *pb.HookEvent_SessionStart:
		return map[string]any{"hooks": p.SessionStart.GetHooks()}
	case *pb.HookEvent_RunStart:
		return map[string]any{"input_chars": len(p.RunStart.GetInput())}
	case *pb.HookEvent_ModelRequest:
		r := p.ModelRequest.GetRequest()
		tools := []string{}
		for _, t := range r.GetTools() {
			tools = append(tools, t.GetName())
		}
		return map[string]any{"model": r.GetModel(), "tools": tools, "history_messages": len(r.GetHistory())}
	case *pb.HookEvent_TextDelta:
		return map[string]any{"chars": len(p.TextDelta.GetText())}
	case *pb.HookEvent_ModelResponse:
		r := p.ModelResponse.GetResponse()
		calls := []string{}
		for _, b := range r.GetMessage().GetBlocks() {
			if c := b.GetToolCall(); c != nil {
				calls = append(calls, c.GetName())
			}
		}
		return map[string]any{"model": r.GetModel(), "finish_reason": r.GetFinishReason(), "tool_calls": calls,
			"input_tokens": r.GetUsage().GetInputTokens(), "output_tokens": r.GetUsage().GetOutputTokens()}
	case *pb.HookEvent_InvalidToolCall:
		return map[string]any{"tool": p.InvalidToolCall.GetCall().GetName(), "problem": p.InvalidToolCall.GetProblem().String()}
	case *pb.HookEvent_ToolCall:
		c := p.ToolCall.GetCall()
		return map[string]any{"tool": c.GetName(), "call_id": c.GetId(), "call_index": p.ToolCall.GetCallIndex(),
			"arguments_bytes": len(c.GetArgumentsJson())}
	case *pb.HookEvent_ToolResult:
		r := p.ToolResult.GetResult()
		return map[string]any{"tool": r.GetName(), "call_id": r.GetCallId(), "is_error": r.GetIsError(),
			"content_chars": len(r.GetContent())}
	case *pb.HookEvent_TurnEnd:
		return map[string]any{"blocks": len(p.TurnEnd.GetMessage().GetBlocks())}
	case *pb.HookEvent_RunEnd:
		e := p.RunEnd
		return map[string]any{"outcome": e.GetOutcome().String(), "reason": e.GetReason(), "turns": e.GetTurns(),
			"input_tokens": e.GetUsage().GetInputTokens(), "output_tokens": e.GetUsage().GetOutputTokens()}
	case *pb.HookEvent_SessionEnd:
		return map[string]any{"reason": p.SessionEnd.GetReason()}
	}
	return nil
}
