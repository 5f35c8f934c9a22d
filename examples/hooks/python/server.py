#!/usr/bin/env python3
"""An example hookwire hook server in Python (grpcio, asyncio).

One process hosts three features, selectable with --features:
  redactor  masks e-mails, API keys and SECRET-... tokens (redactor.py)
  policy    denies or asks for approval on dangerous tools (policy.py)
  tools     owns get_weather and lookup_customer (tools.py)

    python3 server.py --port 50061          # prints "listening on 50061"
    python3 server.py --port 0              # prints the port it bound

It also serves grpc.health.v1 (SERVING for "" and "hookwire.v1.HookService").

TLS and credentials (what a hook server in a cluster should ask for):

    python3 server.py --tls-cert tls.crt --tls-key tls.key          # TLS
        --tls-client-ca ca.crt      # ... and require a client certificate (mTLS)
        --require-token-file token  # ... and `authorization: Bearer <token>`

Certificate and token files are read again when they change, so rotated
Secrets take effect without a restart. Health stays open (probes carry no
credentials).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hookproto import common, pb, pb_grpc
from hooklib import Feature, RunState, event_name, proceed
from policy import Policy
from redactor import Redactor
from tools import Tools

log = logging.getLogger("hook")

NAME, VERSION = "hookwire-example-python", "0.1.0"
SERVICE = "hookwire.v1.HookService"


class HookServer(pb_grpc.HookServiceServicer):
    def __init__(self, features: list[Feature], simulate_latency_ms: int = 0):
        self.features = features
        self.latency = simulate_latency_ms / 1000

    async def Describe(self, request, context):
        events = sorted({kind for f in self.features for kind in f.events})
        tools = [spec for f in self.features for spec in f.tools()]
        return pb.DescribeResponse(name=NAME, version=VERSION, events=events, tools=tools)

    async def CallTool(self, request, context):
        for feature in self.features:
            if feature.owns(request.call.name):
                return await feature.call_tool(request)
        # hookwire only calls tools we listed in Describe, so this is a
        # configuration mismatch, not a model mistake: an error status.
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tool {request.call.name!r}")

    async def Process(self, request_iterator, context):
        """One stream = one run. Events are read by a task of their own and
        each blocking event is decided in its own task, so a slow decision
        never delays reading (and timing) the next event; verdicts go out as
        they are ready, matched by seq."""
        metadata = dict(context.invocation_metadata() or ())
        run = RunState(traceparent=metadata.get("traceparent", ""))
        verdicts: asyncio.Queue[pb.HookVerdict | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def answer(event: pb.HookEvent, received: float) -> None:
            verdicts.put_nowait(await self._answer(event, run, received))

        async def read_events() -> None:
            # The TaskGroup waits for every pending answer once hookwire
            # half-closes the stream (after run_end); a failing task cancels
            # the others and fails the stream.
            async with asyncio.TaskGroup() as tasks:
                async for event in request_iterator:
                    run.record(event)
                    log.debug("run %s: %s seq %d received (deadline %d ms)", run.run_id,
                              event_name(event.kind), event.seq,
                              event.context.deadline_remaining_ms)
                    if event.expects_verdict:
                        tasks.create_task(answer(event, loop.time()))
                    else:
                        # Observe events (and every event of a hook configured
                        # with mode: observe) must NOT be answered.
                        self._observe(event, run)

        reader = asyncio.create_task(read_events())
        reader.add_done_callback(lambda _: verdicts.put_nowait(None))
        try:
            while (v := await verdicts.get()) is not None:
                yield v
            await reader  # re-raises what went wrong, if anything
            if run.run_id:  # session streams carry no run
                # The traceparent is the stream's opening hook span in
                # hookwire's trace: spans made here under it join that trace.
                log.info("%s; outcome=%s trace=%s", run.summary(), run.outcome or "-",
                         run.traceparent or "-")
        except Exception:
            # A bug here must not look like "continue": failing the stream
            # lets hookwire apply the hook's failure policy (closed by
            # default). Details stay in our log, never in the status.
            log.exception("run %s: stream failed", run.run_id)
            await context.abort(grpc.StatusCode.INTERNAL, "hook server error")
        finally:
            reader.cancel()  # the client went away: stop reading

    async def _answer(self, event: pb.HookEvent, run: RunState, received: float) -> pb.HookVerdict:
        """Decide within the deadline hookwire gave us, or answer continue.

        A verdict that arrives after context.deadline_remaining_ms is
        discarded and counts as a hook failure, so giving up in time is always
        better. Continue is this example's choice; a strict guardrail could
        answer terminate instead.
        """
        remaining_ms = event.context.deadline_remaining_ms
        budget = None  # 0 = no deadline sent (hand-written test clients)
        if remaining_ms:
            # Time already spent since the event arrived, and a margin for the
            # verdict's trip back: 10% of the deadline, at most 50 ms.
            loop = asyncio.get_running_loop()
            budget = remaining_ms / 1000 - min(0.05, remaining_ms / 10_000) - (loop.time() - received)
        try:
            if budget is not None and budget <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self._decide(event, run), budget)
        except TimeoutError:
            run.notes["gave_up"] += 1
            log.warning("run %s: %s seq %d: out of time, answering continue",
                        run.run_id, event_name(event.kind), event.seq)
            return proceed(event, reason="hook ran out of time; no decision")

    async def _decide(self, event: pb.HookEvent, run: RunState) -> pb.HookVerdict:
        if self.latency:
            await asyncio.sleep(self.latency)  # stands in for e.g. a model call
        for feature in self.features:
            if event.kind in feature.events:
                verdict = await feature.on_event(event, run)
                if verdict is not None:
                    return verdict
        return proceed(event)

    def _observe(self, event: pb.HookEvent, run: RunState) -> None:
        kind = event.WhichOneof("payload")
        if kind == "run_end":
            end = event.run_end
            # The enum only grows: print a number for outcomes newer than our stubs.
            outcome = (common.RunOutcome.Name(end.outcome).removeprefix("RUN_OUTCOME_").lower()
                       if end.outcome in common.RunOutcome.values() else str(end.outcome))
            run.outcome = f"{outcome} after {end.turns} turn(s)"
        elif kind == "session_end":
            log.info("session %s ended (%s)", event.context.session_id, event.session_end.reason)


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses every HookService call whose `authorization` metadata is not
    `Bearer <the token in FILE>`; the file is read per call, so a rotated
    Secret takes effect at once. Health is left open for probes."""

    def __init__(self, path: str):
        self.path = Path(path)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health."):
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        want = "Bearer " + self.path.read_text().strip()
        if hmac.compare_digest(sent.encode(), want.encode()):
            return handler

        async def deny(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def tls_credentials(args):
    """Server credentials from --tls-*, re-read when the files change
    (grpcio asks the fetcher at every new handshake)."""
    paths = [args.tls_cert, args.tls_key] + ([args.tls_client_ca] if args.tls_client_ca else [])
    state = {"stamp": None}

    def read():
        cert, key = Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes()
        ca = Path(args.tls_client_ca).read_bytes() if args.tls_client_ca else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch():
        stamp = tuple(Path(p).read_bytes() for p in paths)
        if stamp == state["stamp"]:
            return None  # unchanged: keep the current configuration
        state["stamp"] = stamp
        log.info("TLS files (re)loaded")
        return read()

    initial = fetch()
    return grpc.dynamic_ssl_server_credentials(
        initial, fetch, require_client_authentication=bool(args.tls_client_ca)
    )


def parse_deny_for(values: list[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for v in values:
        principal, _, tools = v.partition("=")
        if not principal or not tools:
            raise SystemExit(f"--deny-for {v!r}: expected PRINCIPAL=tool1,tool2")
        out.setdefault(principal, set()).update(t.strip() for t in tools.split(",") if t.strip())
    return out


def build_features(args) -> list[Feature]:
    names = [n.strip() for n in args.features.split(",") if n.strip()]
    split = lambda s: {n.strip() for n in s.split(",") if n.strip()}  # noqa: E731
    make = {
        "redactor": lambda: Redactor(args.redactor_mode),
        "policy": lambda: Policy(deny=split(args.deny), ask=split(args.ask),
                                 deny_for=parse_deny_for(args.deny_for)),
        "tools": lambda: Tools(),
    }
    unknown = [n for n in names if n not in make]
    if unknown:
        raise SystemExit(f"unknown feature(s) {', '.join(unknown)}; choose from {', '.join(make)}")
    return [make[n]() for n in names]


async def serve(args) -> None:
    interceptors = [RequireToken(args.require_token_file)] if args.require_token_file else []
    options = [
        # hookwire keeps channels alive with HTTP/2 pings, also between
        # runs. gRPC's default server policy answers pings more frequent
        # than every 5 minutes with GOAWAY (too_many_pings): accept them.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]
    if args.max_concurrent_streams:
        # Streams per HTTP/2 connection, as a proxy in front would cap them;
        # each run holds one, and hookwire opens more connections.
        options.append(("grpc.max_concurrent_streams", args.max_concurrent_streams))
    server = grpc.aio.server(interceptors=interceptors, options=options)
    pb_grpc.add_HookServiceServicer_to_server(
        HookServer(build_features(args), args.simulate_latency_ms), server
    )
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        port = server.add_secure_port(f"{args.host}:{args.port}", tls_credentials(args))
    elif args.tls_client_ca:
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
    else:
        port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    for service in ("", SERVICE):
        await health_service.set(service, health_pb2.HealthCheckResponse.SERVING)
    # Tests and scripts read this line to learn the port (with --port 0).
    print(f"listening on {port}", flush=True)
    log.info("features: %s", args.features)

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    # Kubernetes sends SIGTERM: report NOT_SERVING, then let running streams
    # (runs in flight) finish for up to --grace seconds.
    await health_service.enter_graceful_shutdown()
    await server.stop(grace=args.grace)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=50061, help="0 picks a free port")
    p.add_argument("--features", default="redactor,policy,tools", help="comma-separated")
    p.add_argument("--deny", default="delete_file,shell", help="policy: tools to deny")
    p.add_argument("--ask", default="send_email", help="policy: tools that need approval")
    p.add_argument("--deny-for", action="append", default=[], metavar="PRINCIPAL=TOOLS",
                   help="policy: tools denied to one caller (EventContext.principal); repeatable")
    p.add_argument("--tls-cert", help="serve TLS with this PEM certificate chain")
    p.add_argument("--tls-key", help="... and this PEM private key")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this PEM CA (mTLS)")
    p.add_argument("--require-token-file",
                   help="require `authorization: Bearer <contents of this file>` on HookService calls")
    p.add_argument("--redactor-mode", default="rewrite", choices=["rewrite", "telemetry"],
                   help="rewrite content, or only mask it in telemetry")
    p.add_argument("--max-concurrent-streams", type=int, default=0,
                   help="cap streams (runs) per HTTP/2 connection; 0: no cap")
    p.add_argument("--simulate-latency-ms", type=int, default=0,
                   help="pretend every decision takes this long (to see deadline handling)")
    p.add_argument("--grace", type=float, default=5.0, help="shutdown grace period, seconds")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
