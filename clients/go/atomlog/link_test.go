package atomlog

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// fakeLink accepts connections and answers each call frame with answer(method, timeout
// ms, token, request body): (kind, payload).
func fakeLink(t *testing.T, answer func(method byte, timeoutMs uint32, token string, body []byte) (byte, []byte)) string {
	return fakeListener(t, linkMagic, func(conn net.Conn) {
		for {
			frame, err := readCallFrame(conn)
			if err != nil {
				return
			}
			tokenLength := int(binary.BigEndian.Uint16(frame[5:7]))
			kind, payload := answer(frame[0], binary.BigEndian.Uint32(frame[1:5]),
				string(frame[7:7+tokenLength]), frame[7+tokenLength:])
			out := binary.BigEndian.AppendUint32(nil, uint32(len(payload)+1))
			conn.Write(append(append(out, kind), payload...))
		}
	})
}

// readCallFrame reads one call frame: what follows its kind (method, timeout, token,
// request).
func readCallFrame(conn net.Conn) ([]byte, error) {
	head := make([]byte, 5)
	if _, err := io.ReadFull(conn, head); err != nil {
		return nil, err
	}
	frame := make([]byte, binary.BigEndian.Uint32(head[:4])-1)
	if _, err := io.ReadFull(conn, frame); err != nil {
		return nil, err
	}
	if head[4] != linkKindCall {
		return nil, errors.New("not a call frame")
	}
	return frame, nil
}

// fakeListener accepts connections and hands each one that opens with `magic` to serve
// (others, and each once served, are closed); serve nil closes every connection once
// its magic came.
func fakeListener(t *testing.T, magic string, serve func(net.Conn)) string {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { listener.Close() })
	go func() {
		for {
			conn, err := listener.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				got := make([]byte, len(magic))
				if _, err := io.ReadFull(conn, got); err != nil || string(got) != magic || serve == nil {
					return
				}
				serve(conn)
			}()
		}
	}()
	return listener.Addr().String()
}

func TestLinkCallFramesAndAnswers(t *testing.T) {
	var seen atomic.Int32
	address := fakeLink(t, func(method byte, timeoutMs uint32, token string, body []byte) (byte, []byte) {
		request := &pb.CommitTxnRequest{}
		if method != linkMethods[pb.CoordinatorService_CommitTxn_FullMethodName] || proto.Unmarshal(body, request) != nil || token != "secret" ||
			timeoutMs == 0 || timeoutMs > 5000 {
			return linkKindError, mustMarshal(t, &pb.ItemError{Reason: "INVALID_ARGUMENT", Message: "bad frame"})
		}
		seen.Add(1)
		if request.GetIdempotencyKey() == "refused" {
			return linkKindError, mustMarshal(t, &pb.ItemError{Reason: "PRODUCER_FENCED",
				Message: "a newer session", Metadata: map[string]string{"epoch": "3"}})
		}
		return linkKindAnswer, mustMarshal(t, &pb.CommitTxnResponse{AlreadyEnded: true})
	})
	token, err := newBearer("secret", "")
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	link := newServerLink(address, "127.0.0.1:1", nil, token, &calls)
	defer link.close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i := 0; i < 3; i++ { // on one kept connection
		out := &pb.CommitTxnResponse{}
		if err := link.call(ctx, linkMethods[pb.CoordinatorService_CommitTxn_FullMethodName], &pb.CommitTxnRequest{IdempotencyKey: "k"}, out); err != nil ||
			!out.GetAlreadyEnded() {
			t.Fatalf("call %d: %v %v", i, out, err)
		}
	}
	if link.connects != 1 || calls.Load() != 3 || seen.Load() != 3 {
		t.Fatalf("connects %d, calls %d, seen %d", link.connects, calls.Load(), seen.Load())
	}
	// A refusal is what the gRPC call would have returned: the reason, its code, metadata.
	err = fromRPC(ctx, link.call(ctx, linkMethods[pb.CoordinatorService_CommitTxn_FullMethodName], &pb.CommitTxnRequest{IdempotencyKey: "refused"},
		&pb.CommitTxnResponse{}))
	var typed *Error
	if !errors.As(err, &typed) || typed.Reason != "PRODUCER_FENCED" || typed.Metadata["epoch"] != "3" ||
		!errors.Is(err, ErrProducerFenced) || typed.Code != reasons["PRODUCER_FENCED"].code {
		t.Fatalf("refusal: %#v", err)
	}
}

// grpcCoordinator answers NewTxn over gRPC, counting the calls.
type grpcCoordinator struct {
	pb.UnimplementedCoordinatorServiceServer
	calls atomic.Int32
}

func (g *grpcCoordinator) NewTxn(context.Context, *pb.NewTxnRequest) (*pb.NewTxnResponse, error) {
	g.calls.Add(1)
	return &pb.NewTxnResponse{}, nil
}

func TestLinkUnreachableFallsBackToGRPCForAWhile(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server, coordinator := grpc.NewServer(), &grpcCoordinator{}
	pb.RegisterCoordinatorServiceServer(server, coordinator)
	go server.Serve(listener)
	defer server.Stop()
	conn, err := grpc.NewClient(listener.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	nowhere, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	address := nowhere.Addr().String()
	nowhere.Close() // nothing listens there now: the link is unreachable
	var calls atomic.Int64
	link := newServerLink(address, address, nil, nil, &calls)
	stub := pb.NewCoordinatorServiceClient(linkedConn{ClientConn: conn, link: link})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i := 0; i < 2; i++ {
		if _, err := stub.NewTxn(ctx, &pb.NewTxnRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	// Both went over gRPC; the second did not try the link again (down for linkRetryAfter).
	if coordinator.calls.Load() != 2 || link.connects != 1 || calls.Load() != 0 {
		t.Fatalf("via gRPC %d, connects %d, link calls %d", coordinator.calls.Load(), link.connects,
			calls.Load())
	}
}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestLinkDropsAKeptConnectionTheServerClosed(t *testing.T) {
	var calls atomic.Int64
	var served atomic.Int32
	address := fakeLink(t, func(method byte, _ uint32, _ string, _ []byte) (byte, []byte) {
		served.Add(1)
		return linkKindAnswer, mustMarshal(t, &pb.NewTxnResponse{})
	})
	link := newServerLink(address, address, nil, nil, &calls)
	defer link.close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := link.call(ctx, linkMethods[pb.CoordinatorService_NewTxn_FullMethodName], &pb.NewTxnRequest{}, &pb.NewTxnResponse{}); err != nil {
		t.Fatal(err)
	}
	link.mu.Lock()
	link.idle[0].conn.(*net.TCPConn).CloseRead() // as if the server had closed it: EOF
	link.mu.Unlock()
	if err := link.call(ctx, linkMethods[pb.CoordinatorService_NewTxn_FullMethodName], &pb.NewTxnRequest{}, &pb.NewTxnResponse{}); err != nil {
		t.Fatalf("the second call failed instead of taking a new connection: %v", err)
	}
	if link.connects != 2 || served.Load() != 2 {
		t.Fatalf("connects %d, served %d", link.connects, served.Load())
	}
}

// TestLinkCapsItsConnections: with linkMaxConns calls under way on one server's link, the
// next goes over gRPC (errLinkUnavailable) without marking the link down, instead of
// dialing without a bound (a client with hundreds of long polls at once filled the
// server's link, whose connection limit every client and server shares).
func TestLinkCapsItsConnections(t *testing.T) {
	release := make(chan struct{})
	var arrived atomic.Int32
	address := fakeLink(t, func(byte, uint32, string, []byte) (byte, []byte) {
		arrived.Add(1)
		<-release
		return linkKindAnswer, mustMarshal(t, &pb.NewTxnResponse{})
	})
	var calls atomic.Int64
	link := newServerLink(address, address, nil, nil, &calls)
	defer link.close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	method := linkMethods[pb.CoordinatorService_NewTxn_FullMethodName]
	done := make(chan error, linkMaxConns)
	for i := 0; i < linkMaxConns; i++ {
		go func() { done <- link.call(ctx, method, &pb.NewTxnRequest{}, &pb.NewTxnResponse{}) }()
	}
	for arrived.Load() < linkMaxConns {
		time.Sleep(5 * time.Millisecond)
	}
	if err := link.call(ctx, method, &pb.NewTxnRequest{}, &pb.NewTxnResponse{}); !errors.Is(err, errLinkUnavailable) {
		t.Fatalf("call beyond the cap: %v", err)
	}
	if link.isDown() {
		t.Fatal("a full link was marked down")
	}
	close(release)
	for i := 0; i < linkMaxConns; i++ {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	link.mu.Lock()
	open, idle := link.open, len(link.idle)
	link.mu.Unlock()
	if open != idle || idle != linkMaxIdle {
		t.Fatalf("open %d, idle %d after the calls", open, idle)
	}
	if err := link.call(ctx, method, &pb.NewTxnRequest{}, &pb.NewTxnResponse{}); err != nil {
		t.Fatalf("a call after: %v", err)
	}
}
