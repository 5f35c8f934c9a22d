#!/usr/bin/env node
// A hookwire hook server in Node.js (@grpc/grpc-js + @grpc/proto-loader),
// with three features:
//
//   redactor  run_start, tool_result: masks e-mail addresses and sk-... API
//             keys in the user input and in tool results (rewrite_input,
//             rewrite_result, plus telemetry_redaction so spans record the
//             masked text);
//   policy    tool_call: skips every delete_* tool with an error result the
//             model reads, and asks the client to approve send_* tools;
//   tools     owns convert_temperature (Describe + CallTool).
//
//   npm start -- --port 50063      (--port 0 picks a free port)
//
// It prints `listening on PORT` on stdout once it serves; logs go to stderr.
// The proto is read from HOOKWIRE_PROTO_DIR, else from this repository's
// proto/ (three directories up).
"use strict";

const path = require("node:path");
const fs = require("node:fs");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const { HealthImplementation } = require("grpc-health-check");

const NAME = "hookwire-example-node";
const VERSION = "0.1.0";

// How the proto is loaded decides what the objects look like. These options
// make them match the proto and the docs (docs/writing-hooks.md, "Node.js"):
//   keepCase  field names as in the proto (run_start, rewrite_input); the
//             default turns them into camelCase (runStart), and a verdict
//             written with the proto's names then encodes as empty;
//   longs     uint64 seq as a String (the default is a Long object); echo
//             it back unchanged;
//   enums     enum values by name ("EVENT_KIND_RUN_START"), not numbers;
//   oneofs    a virtual field naming the set member: event.payload is
//             "run_start", "tool_call", ...;
//   defaults  absent fields read as their defaults ("" / 0 / [] / {}).
const LOADER_OPTIONS = {
  keepCase: true,
  longs: String,
  enums: String,
  oneofs: true,
  defaults: true,
};

function protoDir() {
  if (process.env.HOOKWIRE_PROTO_DIR) return process.env.HOOKWIRE_PROTO_DIR;
  const inTree = path.resolve(__dirname, "..", "..", "..", "proto");
  if (!fs.existsSync(path.join(inTree, "hookwire", "v1", "hook.proto"))) {
    console.error(
      `no hookwire/v1/hook.proto under ${inTree}: set HOOKWIRE_PROTO_DIR to a directory holding hookwire/v1/*.proto`
    );
    process.exit(2);
  }
  return inTree;
}

function args(argv) {
  const out = { host: "127.0.0.1", port: 50063 };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = argv[i + 1];
    if (flag === "--port") {
      out.port = Number.parseInt(value, 10);
      i++;
    } else if (flag === "--host") {
      out.host = value;
      i++;
    } else if (flag === "--help" || flag === "-h") {
      console.log("usage: node server.js [--host 127.0.0.1] [--port 50063]   (--port 0 = any free port)");
      process.exit(0);
    } else {
      console.error(`unknown argument ${flag} (try --help)`);
      process.exit(2);
    }
  }
  if (!Number.isInteger(out.port) || out.port < 0 || out.port > 65535) {
    console.error("--port must be a port number (0 = any free port)");
    process.exit(2);
  }
  return out;
}

// ------------------------------------------------------------- redactor

// The e-mail pattern starts only where a run of name characters starts and
// reads at most 64 of them (an address's local part): unanchored, it tried
// every position of a long run without an "@" (a token, base64, hex), which
// is quadratic and blocks the event loop, and with it every stream.
const PATTERNS = [
  ["email", /(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}/g],
  ["api_key", /\bsk-[A-Za-z0-9_-]{8,}/g],
];

/** At most 200 characters of `s`, marked when cut. */
function shorten(s) {
  return s.length > 200 ? `${s.slice(0, 200)}...` : s;
}

/** The text with every match masked, and a summary such as "1 email". */
function redact(text) {
  const counts = [];
  let out = text;
  for (const [kind, re] of PATTERNS) {
    let n = 0;
    out = out.replace(re, () => {
      n++;
      return `[REDACTED:${kind}]`;
    });
    if (n > 0) counts.push(`${n} ${kind}`);
  }
  return { text: out, summary: counts.join(", ") };
}

// --------------------------------------------------------------- policy

function toolCall(event) {
  const name = event.tool_call.call.name;
  if (name.startsWith("delete_")) {
    return {
      verdict: {
        tool_call: {
          skip: {
            result: `The tool '${name}' is not allowed by policy. Answer without it.`,
            is_error: true,
          },
        },
      },
      reason: `tool ${name} is denied by policy`,
    };
  }
  if (name.startsWith("send_")) {
    return {
      verdict: {
        tool_call: {
          ask: {
            // Bounded: a question over 64 KiB makes the verdict invalid.
            question: `Allow the agent to call ${name} with ${shorten(event.tool_call.call.arguments_json)}?`,
            timeout_ms: 0,
          },
        },
      },
      reason: `tool ${name} needs approval`,
    };
  }
  return { verdict: { tool_call: { proceed: {} } } };
}

// ---------------------------------------------------------------- tools

const TOOLS = [
  {
    name: "convert_temperature",
    description: "Convert a temperature between Celsius (C) and Fahrenheit (F).",
    parameters_json_schema: JSON.stringify({
      type: "object",
      properties: {
        value: { type: "number", examples: [21] },
        from: { type: "string", enum: ["C", "F"], examples: ["C"] },
      },
      required: ["value", "from"],
    }),
  },
];

function callTool(call) {
  if (call.name !== "convert_temperature") {
    const err = new Error(`this server owns no tool '${call.name}'`);
    err.code = grpc.status.NOT_FOUND;
    throw err;
  }
  let a;
  try {
    a = JSON.parse(call.arguments_json);
  } catch (e) {
    return { content: `arguments are not JSON: ${e.message}`, is_error: true };
  }
  if (typeof a.value !== "number" || !["C", "F"].includes(a.from)) {
    return { content: "expected {value: number, from: 'C' | 'F'}", is_error: true };
  }
  const round = (x) => Math.round(x * 10) / 10;
  return a.from === "C"
    ? { content: `${a.value}°C is ${round((a.value * 9) / 5 + 32)}°F`, is_error: false }
    : { content: `${a.value}°F is ${round(((a.value - 32) * 5) / 9)}°C`, is_error: false };
}

// -------------------------------------------------------------- events

/** The verdict for one blocking event (null: answer continue). */
function decide(event) {
  switch (event.payload) {
    case "run_start": {
      const r = redact(event.run_start.input);
      if (!r.summary) return null;
      return {
        verdict: { run_start: { rewrite_input: { input: r.text } } },
        reason: `redacted ${r.summary}`,
        telemetry_redaction: r.text,
      };
    }
    case "tool_result": {
      const r = redact(event.tool_result.result.content);
      if (!r.summary) return null;
      return {
        verdict: { tool_result: { rewrite_result: { content: r.text } } },
        reason: `redacted ${r.summary}`,
        telemetry_redaction: r.text,
      };
    }
    case "tool_call":
      return toolCall(event);
    default:
      return null;
  }
}

/** `continue` in the verdict field named like the event. */
function proceed(event) {
  return { [event.payload]: { proceed: {} } };
}

function process_(call) {
  // One stream per run: per-run state would live here. Several events may
  // be in flight at once (tool calls with tool_concurrency > 1): each is
  // answered by its own seq, captured per event, never from a shared
  // "current event".
  let events = 0;
  call.on("data", (event) => {
    events++;
    // Observe-only events (text_delta, run_end, session_end) and
    // mode: observe must not be answered.
    if (!event.expects_verdict) return;
    const d = decide(event);
    const v = { seq: event.seq, reason: d ? d.reason || "" : "" };
    Object.assign(v, d ? d.verdict : proceed(event));
    if (d && d.telemetry_redaction !== undefined) v.telemetry_redaction = d.telemetry_redaction;
    call.write(v);
  });
  call.on("end", () => {
    // hookwire half-closed the stream after run_end: end ours with OK.
    console.error(`stream ended after ${events} event(s)`);
    call.end();
  });
  call.on("error", (e) => console.error(`stream error: ${e.message}`));
}

function main() {
  const opts = args(process.argv.slice(2));
  const dir = protoDir();
  const def = protoLoader.loadSync(path.join(dir, "hookwire", "v1", "hook.proto"), {
    ...LOADER_OPTIONS,
    includeDirs: [dir],
  });
  const hookwire = grpc.loadPackageDefinition(def).hookwire.v1;

  const server = new grpc.Server();
  server.addService(hookwire.HookService.service, {
    Describe: (call, cb) =>
      cb(null, {
        name: NAME,
        version: VERSION,
        events: ["EVENT_KIND_RUN_START", "EVENT_KIND_TOOL_CALL", "EVENT_KIND_TOOL_RESULT"],
        tools: TOOLS,
      }),
    Process: process_,
    CallTool: (call, cb) => {
      try {
        cb(null, callTool(call.request.call || {}));
      } catch (e) {
        cb({ code: e.code || grpc.status.INTERNAL, message: e.message });
      }
    },
  });
  const health = new HealthImplementation({
    "": "SERVING",
    "hookwire.v1.HookService": "SERVING",
  });
  health.addToServer(server);

  server.bindAsync(`${opts.host}:${opts.port}`, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      console.error(`cannot listen on ${opts.host}:${opts.port}: ${err.message}`);
      process.exit(1);
    }
    console.log(`listening on ${port}`);
  });

  const stop = () => {
    health.setStatus("", "NOT_SERVING");
    health.setStatus("hookwire.v1.HookService", "NOT_SERVING");
    // Running streams get a moment to finish, then the rest is closed.
    const force = setTimeout(() => server.forceShutdown(), 5000);
    server.tryShutdown(() => {
      clearTimeout(force);
      process.exit(0);
    });
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
}

main();
