// Command hook-server is an example hookwire hook server in Go: it owns a
// tool (word_count) and, with --audit-log, is an audit observer that appends
// one JSON line per event of every run to a file.
//
//	make run                                   # build, then serve on 50062
//	bin/hook-server --port 0 --audit-log a.jsonl   # prints "listening on PORT"
//
// It serves grpc.health.v1 (SERVING for "" and "hookwire.v1.HookService").
package main

import (
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	pb "hookwire.example/gen/hookwirev1"
)

const serviceName = "hookwire.v1.HookService"

func main() {
	host := flag.String("host", "127.0.0.1", "address to bind (0.0.0.0 in a container)")
	port := flag.Int("port", 50062, "port to listen on; 0 picks a free one")
	auditPath := flag.String("audit-log", "", "append one JSON line per event to this file (empty: no events, tools only)")
	auditContent := flag.Bool("audit-content", false, "also record event payloads in the audit log (they may hold sensitive data)")
	grace := flag.Duration("grace", 5*time.Second, "how long running streams may finish on SIGTERM")
	flag.Parse()
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)

	var audit *Audit
	if *auditPath != "" {
		var err error
		if audit, err = OpenAudit(*auditPath, *auditContent); err != nil {
			log.Fatalf("audit log: %v", err)
		}
		defer audit.Close()
	}

	lis, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		log.Fatalf("listen: %v", err)
	}
	srv, hs := NewServer(&HookServer{Audit: audit})
	// Tests and scripts read this line (on stdout) to learn the port.
	fmt.Printf("listening on %d\n", lis.Addr().(*net.TCPAddr).Port)

	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
		<-sig
		// Kubernetes sends SIGTERM: report NOT_SERVING, let runs in flight
		// finish their streams, then stop hard after the grace period.
		hs.Shutdown()
		done := make(chan struct{})
		go func() { srv.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-time.After(*grace):
			srv.Stop()
		}
	}()
	if err := srv.Serve(lis); err != nil {
		log.Fatalf("serve: %v", err)
	}
}

// NewServer builds the gRPC server with the hook service and health.
func NewServer(h *HookServer) (*grpc.Server, *health.Server) {
	srv := grpc.NewServer(
		// hookwire keeps its channels alive with HTTP/2 pings, also between
		// runs. grpc-go's default policy answers pings more frequent than
		// every 5 minutes with GOAWAY (too_many_pings): accept them.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             10 * time.Second,
			PermitWithoutStream: true,
		}),
	)
	pb.RegisterHookServiceServer(srv, h)
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus(serviceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(srv, hs)
	return srv, hs
}
