package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "hookwire.example/gen/hookwirev1"
)

// A tool this server owns: advertised by Describe, executed by CallTool.
type tool struct {
	description string
	schema      string // JSON Schema of the arguments object
	run         func(args json.RawMessage) (string, error)
}

var tools = map[string]tool{
	"word_count": {
		description: "Count the words, lines and characters of a text.",
		schema: `{"type":"object","properties":{"text":{"type":"string","description":"The text to count"}},` +
			`"required":["text"],"additionalProperties":false}`,
		run: wordCount,
	},
}

func toolSpecs() []*pb.ToolSpec {
	specs := []*pb.ToolSpec{}
	for name, t := range tools {
		specs = append(specs, &pb.ToolSpec{Name: name, Description: t.description, ParametersJsonSchema: t.schema})
	}
	return specs
}

// CallTool runs an owned tool. Bad arguments are the model's mistake: they
// come back as an is_error result the model can read and correct. A tool we
// do not own is a configuration mismatch: an error status.
func (h *HookServer) CallTool(ctx context.Context, req *pb.CallToolRequest) (*pb.CallToolResponse, error) {
	t, ok := tools[req.GetCall().GetName()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "unknown tool %q", req.GetCall().GetName())
	}
	out, err := t.run(json.RawMessage(req.GetCall().GetArgumentsJson()))
	if err != nil {
		return &pb.CallToolResponse{Content: err.Error(), IsError: true}, nil
	}
	return &pb.CallToolResponse{Content: out}, nil
}

func wordCount(raw json.RawMessage) (string, error) {
	// Validate against the schema above: an object, "text" required and a
	// string, nothing else. hookwire checks the model's arguments too, but a
	// tool_call hook may have rewritten them since.
	var args struct {
		Text *string `json:"text"`
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&args); err != nil {
		return "", fmt.Errorf("invalid arguments: %v", err)
	}
	if dec.More() {
		return "", fmt.Errorf("invalid arguments: trailing data after the JSON object")
	}
	if args.Text == nil {
		return "", fmt.Errorf("invalid arguments: text is required")
	}
	text := *args.Text
	lines := strings.Count(text, "\n")
	if text != "" && !strings.HasSuffix(text, "\n") {
		lines++
	}
	out, err := json.Marshal(map[string]int{
		"words":      len(strings.Fields(text)),
		"lines":      lines,
		"characters": utf8.RuneCountInString(text),
	})
	return string(out), err
}
