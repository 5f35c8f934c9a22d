// A hook server as a Node.js author writes it from the proto alone, but
// loading the proto with @grpc/proto-loader's DEFAULT options: its objects
// then use camelCase names (runStart), so the verdict it writes with the
// proto's snake_case names (run_start) encodes as an empty HookVerdict. The
// checker must say why. Run from examples/hooks/node (its packages).
"use strict";

const path = require("node:path");
const grpc = require(path.resolve("node_modules/@grpc/grpc-js"));
const protoLoader = require(path.resolve("node_modules/@grpc/proto-loader"));

const dir = path.resolve("../../../proto");
const def = protoLoader.loadSync(path.join(dir, "hookwire/v1/hook.proto"), { includeDirs: [dir] });
const hookwire = grpc.loadPackageDefinition(def).hookwire.v1;

const server = new grpc.Server();
server.addService(hookwire.HookService.service, {
  Describe: (call, cb) => cb(null, { name: "default-options", version: "0", events: ["EVENT_KIND_RUN_START"] }),
  Process: (call) => {
    call.on("data", (ev) => {
      if (ev.expects_verdict || ev.expectsVerdict) {
        call.write({ seq: ev.seq, run_start: { proceed: {} } });
      }
    });
    call.on("end", () => call.end());
  },
  CallTool: (call, cb) => cb({ code: grpc.status.UNIMPLEMENTED, message: "no tools" }),
});
server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (err, port) => {
  if (err) throw err;
  console.log(`listening on ${port}`);
});
