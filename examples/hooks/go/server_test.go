package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "hookwire.example/gen/hookwirev1"
)

const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

// start serves a HookServer on a free loopback port, as a real gRPC server.
func start(t *testing.T, audit *Audit) *grpc.ClientConn {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := NewServer(&HookServer{Audit: audit})
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	// grpc.WithInsecure: the credentials/insecure package is newer than
	// Debian's grpc-go 1.33.
	conn, err := grpc.Dial(lis.Addr().String(), grpc.WithInsecure(), grpc.WithBlock())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func openAudit(t *testing.T) (*Audit, string) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	a, err := OpenAudit(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a, path
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestDescribe(t *testing.T) {
	audit, _ := openAudit(t)
	d, err := pb.NewHookServiceClient(start(t, audit)).Describe(ctx(t), &pb.DescribeRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Events) != 11 || d.Events[0] != pb.EventKind_EVENT_KIND_SESSION_START ||
		d.Events[10] != pb.EventKind_EVENT_KIND_SESSION_END {
		t.Errorf("events = %v, want all 11", d.Events)
	}
	if len(d.Tools) != 1 || d.Tools[0].Name != "word_count" || !json.Valid([]byte(d.Tools[0].ParametersJsonSchema)) {
		t.Errorf("tools = %v", d.Tools)
	}

	// Without an audit log the server only owns tools.
	d, err = pb.NewHookServiceClient(start(t, nil)).Describe(ctx(t), &pb.DescribeRequest{})
	if err != nil || len(d.Events) != 0 || len(d.Tools) != 1 {
		t.Errorf("tools-only Describe = %v, %v", d, err)
	}
}

type sent struct {
	kind    string
	expects bool
}

// TestProcess drives one run and checks the verdicts and the audit log.
func TestProcess(t *testing.T) {
	audit, path := openAudit(t)
	client := pb.NewHookServiceClient(start(t, audit))
	c := metadata.AppendToOutgoingContext(ctx(t), "traceparent", traceparent)
	stream, err := client.Process(c)
	if err != nil {
		t.Fatal(err)
	}
	call := &pb.ToolCall{Id: "c1", Name: "word_count", ArgumentsJson: `{"text":"SECRET-XYZ"}`}
	events := []struct {
		sent
		payload func(*pb.HookEvent)
	}{
		{sent{"run_start", true}, func(e *pb.HookEvent) {
			e.Payload = &pb.HookEvent_RunStart{RunStart: &pb.RunStartEvent{Input: "count SECRET-XYZ"}}
		}},
		{sent{"model_request", true}, func(e *pb.HookEvent) {
			e.Payload = &pb.HookEvent_ModelRequest{ModelRequest: &pb.ModelRequestEvent{
				Request: &pb.ModelRequest{Model: "scripted", Tools: toolSpecs()}}}
		}},
		{sent{"text_delta", false}, func(e *pb.HookEvent) {
			e.Payload = &pb.HookEvent_TextDelta{TextDelta: &pb.TextDeltaEvent{Text: "Counting"}}
		}},
		{sent{"tool_call", true}, func(e *pb.HookEvent) {
			e.Payload = &pb.HookEvent_ToolCall{ToolCall: &pb.ToolCallEvent{Call: call}}
		}},
		// A blocking event with expects_verdict=false: this hook is
		// configured with mode: observe. It must not be answered.
		{sent{"tool_call", false}, func(e *pb.HookEvent) {
			e.Payload = &pb.HookEvent_ToolCall{ToolCall: &pb.ToolCallEvent{Call: call}}
		}},
		{sent{"tool_result", true}, func(e *pb.HookEvent) {
			e.Payload = &pb.HookEvent_ToolResult{ToolResult: &pb.ToolResultEvent{Call: call,
				Result: &pb.ToolResultBlock{CallId: "c1", Name: "word_count", Content: `{"words":1}`}}}
		}},
		{sent{"turn_end", true}, func(e *pb.HookEvent) {
			e.Payload = &pb.HookEvent_TurnEnd{TurnEnd: &pb.TurnEndEvent{}}
		}},
		{sent{"run_end", false}, func(e *pb.HookEvent) {
			e.Payload = &pb.HookEvent_RunEnd{RunEnd: &pb.RunEndEvent{Outcome: pb.RunOutcome_RUN_OUTCOME_COMPLETED, Turns: 1}}
		}},
	}
	var wantSeqs []uint64
	for i, e := range events {
		ev := &pb.HookEvent{
			Seq:            uint64(i + 1),
			Kind:           pb.EventKind(pb.EventKind_value["EVENT_KIND_"+strings.ToUpper(e.kind)]),
			ExpectsVerdict: e.expects,
			Context: &pb.EventContext{SessionId: "s-1", RunId: "r-1", Agent: "demo", Turn: 1,
				Principal: "alice", DeadlineRemainingMs: 5000, Scratchpad: map[string][]byte{"policy.denied_tools": []byte(`[]`)}},
		}
		e.payload(ev)
		if err := stream.Send(ev); err != nil {
			t.Fatal(err)
		}
		if e.expects {
			wantSeqs = append(wantSeqs, ev.Seq)
		}
	}
	// hookwire half-closes after run_end; the server must then end cleanly.
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var got []*pb.HookVerdict
	for {
		v, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("stream ended with %v", err)
		}
		got = append(got, v)
	}
	if len(got) != len(wantSeqs) {
		t.Fatalf("got %d verdicts, want %d (seqs %v): %v", len(got), len(wantSeqs), wantSeqs, got)
	}
	for i, v := range got {
		want := events[wantSeqs[i]-1].kind
		if v.Seq != wantSeqs[i] {
			t.Errorf("verdict %d: seq %d, want %d", i, v.Seq, wantSeqs[i])
		}
		// The verdict field must match the event kind, and be "continue".
		field := v.ProtoReflect().WhichOneof(v.ProtoReflect().Descriptor().Oneofs().ByName("verdict"))
		if field == nil || string(field.Name()) != want {
			t.Errorf("seq %d: verdict field %v, want %s", v.Seq, field, want)
			continue
		}
		action := v.ProtoReflect().Get(field).Message()
		if a := action.WhichOneof(action.Descriptor().Oneofs().ByName("action")); a == nil || a.Name() != "proceed" {
			t.Errorf("seq %d: action %v, want proceed", v.Seq, a)
		}
	}

	// One audit line per event, in order, carrying the stream's state.
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var lines []map[string]any
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "SECRET") {
			t.Errorf("audit line carries content: %s", sc.Text())
		}
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("bad JSON line %q: %v", sc.Text(), err)
		}
		lines = append(lines, m)
	}
	if len(lines) != len(events) {
		t.Fatalf("%d audit lines, want %d", len(lines), len(events))
	}
	for i, m := range lines {
		if m["event"] != events[i].kind || m["seq"] != float64(i+1) || m["run_events_seen"] != float64(i+1) ||
			m["run_id"] != "r-1" || m["traceparent"] != traceparent || m["expects_verdict"] != events[i].expects ||
			m["principal"] != "alice" {
			t.Errorf("audit line %d = %v", i, m)
		}
	}
	if d := lines[7]["detail"].(map[string]any); d["outcome"] != "RUN_OUTCOME_COMPLETED" {
		t.Errorf("run_end detail = %v", d)
	}
	if keys := lines[0]["scratchpad_keys"].([]any); len(keys) != 1 || keys[0] != "policy.denied_tools" {
		t.Errorf("scratchpad keys = %v", keys)
	}
}

func TestObserveEventWithVerdictIsRejected(t *testing.T) {
	// hookwire never asks for a verdict on run_end; if something does, the
	// server fails the stream instead of inventing a verdict kind.
	stream, err := pb.NewHookServiceClient(start(t, nil)).Process(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	stream.Send(&pb.HookEvent{Seq: 1, Kind: pb.EventKind_EVENT_KIND_RUN_END, ExpectsVerdict: true,
		Payload: &pb.HookEvent_RunEnd{RunEnd: &pb.RunEndEvent{}}})
	if _, err := stream.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Errorf("got %v, want InvalidArgument", err)
	}
}

func TestCallTool(t *testing.T) {
	client := pb.NewHookServiceClient(start(t, nil))
	run := func(name, args string) (*pb.CallToolResponse, error) {
		return client.CallTool(ctx(t), &pb.CallToolRequest{
			Context: &pb.EventContext{RunId: "r-1", DeadlineRemainingMs: 5000},
			Call:    &pb.ToolCall{Id: "c1", Name: name, ArgumentsJson: args},
		})
	}
	r, err := run("word_count", `{"text":"two words\nand a line"}`)
	if err != nil || r.IsError || r.Content != `{"characters":20,"lines":2,"words":5}` {
		t.Errorf("word_count = %v, %v", r, err)
	}
	for _, bad := range []string{`{}`, `{"text":5}`, `{"text":"a","x":1}`, `{not json`, `[]`, `{"text":"a"} {}`, ``} {
		if r, err := run("word_count", bad); err != nil || !r.IsError {
			t.Errorf("word_count(%s) = %v, %v; want is_error", bad, r, err)
		}
	}
	if _, err := run("nope", `{}`); status.Code(err) != codes.NotFound {
		t.Errorf("unknown tool: %v, want NotFound", err)
	}
}

func TestHealth(t *testing.T) {
	client := healthpb.NewHealthClient(start(t, nil))
	for _, svc := range []string{"", serviceName} {
		r, err := client.Check(ctx(t), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q = %v, %v", svc, r, err)
		}
	}
}
