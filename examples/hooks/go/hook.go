package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "hookwire.example/gen/hookwirev1"
)

// HookServer implements hookwire.v1.HookService.
type HookServer struct {
	// Embedded so that methods added to the service later compile and
	// answer UNIMPLEMENTED (grpc-go requires it).
	pb.UnimplementedHookServiceServer

	// Audit receives every event; nil means the server only owns tools and
	// subscribes to no events.
	Audit *Audit
}

// Describe tells hookwire what this server wants and owns.
func (h *HookServer) Describe(ctx context.Context, req *pb.DescribeRequest) (*pb.DescribeResponse, error) {
	resp := &pb.DescribeResponse{Name: "hookwire-example-go", Version: "0.1.0", Tools: toolSpecs()}
	if h.Audit != nil {
		// Every event, text_delta included (it is opt-in: hookwire only
		// sends it to hooks that ask for it).
		for kind := 1; kind < len(pb.EventKind_name); kind++ { // 0 is UNSPECIFIED
			resp.Events = append(resp.Events, pb.EventKind(kind))
		}
	}
	return resp, nil
}

// runState is what the server remembers about one run. hookwire opens one
// Process stream per run, so it lives on the handler's stack: no map, no
// lock, no cleanup.
type runState struct {
	traceparent string // W3C trace context of the run, from stream metadata
	eventsSeen  int
}

// Process handles the events of one run, in order.
func (h *HookServer) Process(stream pb.HookService_ProcessServer) error {
	var run runState
	if md, ok := metadata.FromIncomingContext(stream.Context()); ok {
		if v := md.Get("traceparent"); len(v) > 0 {
			run.traceparent = v[0]
		}
	}
	for {
		ev, err := stream.Recv()
		if err == io.EOF {
			// hookwire half-closed the stream after run_end: returning nil
			// ends our side cleanly (status OK).
			return nil
		}
		if err != nil {
			return err // the run was cancelled or the connection broke
		}
		run.eventsSeen++
		// Blocking events get their answer first, the audit line after, so
		// a slow disk never makes a verdict miss deadline_remaining_ms.
		// Observe events (and every event when this hook is configured with
		// mode: observe) arrive with expects_verdict=false and must not be
		// answered.
		if ev.ExpectsVerdict {
			v, err := proceed(ev)
			if err != nil {
				return status.Error(codes.InvalidArgument, err.Error())
			}
			if err := stream.Send(v); err != nil {
				return err
			}
		}
		if h.Audit != nil {
			if err := h.Audit.Write(ev, &run); err != nil {
				// Losing an audit line must not fail the run; say so loudly.
				log.Printf("audit: run %s seq %d: %v", ev.GetContext().GetRunId(), ev.Seq, err)
			}
		}
	}
}

// proceed answers "continue" to a blocking event. The verdict field must
// match the event kind, or hookwire counts a wrong_kind hook failure.
// ("continue" is spelled Proceed: it is a keyword in Go and elsewhere.)
func proceed(ev *pb.HookEvent) (*pb.HookVerdict, error) {
	c := &pb.Continue{}
	v := &pb.HookVerdict{Seq: ev.Seq}
	switch ev.Kind {
	case pb.EventKind_EVENT_KIND_SESSION_START:
		v.Verdict = &pb.HookVerdict_SessionStart{SessionStart: &pb.SessionStartVerdict{
			Action: &pb.SessionStartVerdict_Proceed{Proceed: c}}}
	case pb.EventKind_EVENT_KIND_RUN_START:
		v.Verdict = &pb.HookVerdict_RunStart{RunStart: &pb.RunStartVerdict{
			Action: &pb.RunStartVerdict_Proceed{Proceed: c}}}
	case pb.EventKind_EVENT_KIND_MODEL_REQUEST:
		v.Verdict = &pb.HookVerdict_ModelRequest{ModelRequest: &pb.ModelRequestVerdict{
			Action: &pb.ModelRequestVerdict_Proceed{Proceed: c}}}
	case pb.EventKind_EVENT_KIND_MODEL_RESPONSE:
		v.Verdict = &pb.HookVerdict_ModelResponse{ModelResponse: &pb.ModelResponseVerdict{
			Action: &pb.ModelResponseVerdict_Proceed{Proceed: c}}}
	case pb.EventKind_EVENT_KIND_INVALID_TOOL_CALL:
		v.Verdict = &pb.HookVerdict_InvalidToolCall{InvalidToolCall: &pb.InvalidToolCallVerdict{
			Action: &pb.InvalidToolCallVerdict_Proceed{Proceed: c}}}
	case pb.EventKind_EVENT_KIND_TOOL_CALL:
		v.Verdict = &pb.HookVerdict_ToolCall{ToolCall: &pb.ToolCallVerdict{
			Action: &pb.ToolCallVerdict_Proceed{Proceed: c}}}
	case pb.EventKind_EVENT_KIND_TOOL_RESULT:
		v.Verdict = &pb.HookVerdict_ToolResult{ToolResult: &pb.ToolResultVerdict{
			Action: &pb.ToolResultVerdict_Proceed{Proceed: c}}}
	case pb.EventKind_EVENT_KIND_TURN_END:
		v.Verdict = &pb.HookVerdict_TurnEnd{TurnEnd: &pb.TurnEndVerdict{
			Action: &pb.TurnEndVerdict_Proceed{Proceed: c}}}
	default:
		// text_delta, run_end and session_end have no verdict.
		return nil, fmt.Errorf("seq %d: %s cannot be answered", ev.Seq, eventName(ev.Kind))
	}
	return v, nil
}

// eventName turns EVENT_KIND_TOOL_CALL into "tool_call", the name hookwire
// uses in config, metrics and spans.
func eventName(k pb.EventKind) string {
	return strings.ToLower(strings.TrimPrefix(k.String(), "EVENT_KIND_"))
}
