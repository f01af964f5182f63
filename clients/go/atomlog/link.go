package atomlog

// The client's calls on the servers' links (docs/clients.md, "The link"). A coordinator
// with coordinator.client_link advertises a link (ServerInfo.link_address): a
// length-prefixed TCP protocol beside its gRPC port, which carries CommitTxn, CommitTxns
// and the streaming path's NewTxn ... EndTxn as call frames. A partition server always
// advertises one, which carries a consumer's Fetch and a subscription's Receive, Ack and
// Nack, and a producer's Produce on a pipelined connection (pipeline.go). A gRPC call costs
// the server (Python) about 0.4 ms of CPU before it does any work; a call frame on a kept
// connection a fraction of it.
//
// What travels is what gRPC would carry: the same request and response messages, the same
// bearer token (under mTLS, the same client certificate), and a refusal comes back as the
// ErrorInfo of the gRPC status it stands for. A failure is returned as the failed gRPC
// call would return it. A link that cannot be reached sends that call, and those of the
// next linkRetryAfter, over gRPC. A connection lost mid-call is SERVER_UNAVAILABLE (the
// outcome unknown), which callers retry as after a gRPC UNAVAILABLE.

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

const (
	linkMagic          = "ATLNK\x00\x00\x01"
	linkKindAnswer     = 0
	linkKindError      = 2
	linkKindCall       = 3
	linkMaxCallBytes   = 64 << 20           // a call frame or its answer
	linkMaxIdle        = 16                 // kept connections per coordinator
	linkMaxConns       = 16                 // connections per server; more calls at once: gRPC
	linkIdle           = 60 * time.Second   // a kept connection unused this long is closed
	linkRetryAfter     = 10 * time.Second   // after a link could not be reached, gRPC this long
	linkConnectTimeout = 5 * time.Second    // connecting, and the TLS handshake
	linkFrameHead      = 5                  // u32 length + u8 kind
	linkCallHead       = 7                  // u8 method + u32 timeout ms + u16 token length
	linkMaxToken       = 0xFFFF             // the token length field's bound
	linkMaxTimeoutMs   = uint64(0xFFFFFFFF) // the timeout field's bound
)

// The methods the link carries, by gRPC full name, and their numbers on the wire
// (services/link_wire.py CALL_METHODS).
var linkMethods = map[string]byte{
	pb.CoordinatorService_CommitTxn_FullMethodName:            4,
	pb.CoordinatorService_CommitTxns_FullMethodName:           5,
	pb.CoordinatorService_NewTxn_FullMethodName:               6,
	pb.CoordinatorService_AddPartitionToTxn_FullMethodName:    7,
	pb.CoordinatorService_AddSubscriptionToTxn_FullMethodName: 8,
	pb.CoordinatorService_PrepareTxn_FullMethodName:           9,
	pb.CoordinatorService_EndTxn_FullMethodName:               10,
	pb.CoordinatorService_GetTxnStatus_FullMethodName:         11,
	pb.PartitionService_Receive_FullMethodName:                13,
	pb.PartitionService_Ack_FullMethodName:                    14,
	pb.PartitionService_Nack_FullMethodName:                   15,
	pb.PartitionService_Fetch_FullMethodName:                  16,
}

// errLinkUnavailable: no connection could be made, or it was refused before any answer;
// the call goes over gRPC.
var errLinkUnavailable = errors.New("the server's link cannot be reached")

// serverLink keeps connections to one server's link; call is safe for
// concurrent use (one call per connection at a time).
type serverLink struct {
	address   string // host:port of the link
	tls       *tls.Config
	token     *bearer
	calls     *atomic.Int64 // the client's count of calls answered on links
	mu        sync.Mutex
	idle      []linkConn
	open      int // connections made and not yet closed: idle and in use (linkMaxConns)
	downUntil time.Time
	connects  int // connections made (tests: kept ones are reused)
	closed    bool
	pipe      *pipeline // a producer's Produce calls (pipeline.go)
}

type linkConn struct {
	conn net.Conn
	used time.Time
}

func newServerLink(address, grpcAddress string, config *tls.Config, token *bearer,
	calls *atomic.Int64) *serverLink {
	if config != nil {
		config = config.Clone()
		if config.ServerName == "" { // as gRPC checks it: the host the client dialed
			host, _, err := net.SplitHostPort(grpcAddress)
			if err != nil {
				host = grpcAddress
			}
			config.ServerName = host
		}
	}
	return &serverLink{address: address, tls: config, token: token, calls: calls}
}

// call sends one call frame and decodes the answer into out. It returns
// errLinkUnavailable when the link cannot be reached (send the call over gRPC), else
// what the gRPC call would have returned.
func (l *serverLink) call(ctx context.Context, method byte, in, out proto.Message) error {
	if l.isDown() {
		return errLinkUnavailable
	}
	frame, err := l.frame(ctx, method, in)
	if err != nil {
		return err
	}
	conn, fresh, err := l.take(ctx)
	if err != nil {
		return err
	}
	deadline, hasDeadline := ctx.Deadline()
	if hasDeadline {
		conn.SetDeadline(deadline)
	} else {
		conn.SetDeadline(time.Time{})
	}
	// A context that ends mid-call aborts the exchange. Once it has fired, the
	// connection's deadline may be in the past: it is not kept.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })
	kind, payload, err := exchange(conn, frame)
	reusable := stop()
	if err != nil {
		l.drop(conn)
		var timeout net.Error
		if errors.As(err, &timeout) && timeout.Timeout() {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return statusOf("REQUEST_TIMED_OUT", fmt.Sprintf("call %d to %s (link) took longer "+
				"than its deadline", method, l.address), nil)
		}
		if fresh { // refused before any answer (the server's connection limit, say)
			l.markDown()
			return errLinkUnavailable
		}
		return statusOf("SERVER_UNAVAILABLE", fmt.Sprintf("call %d to %s (link): %v", method,
			l.address, err), map[string]string{"retry_after_ms": "50"})
	}
	if reusable {
		l.giveBack(conn)
	} else {
		l.drop(conn)
	}
	l.calls.Add(1)
	return decodeAnswer(l.address, kind, payload, nil, out)
}

// frame is the call frame of `method` with `in`, its timeout ctx's deadline and its
// token the client's; errLinkUnavailable when the link cannot carry it.
func (l *serverLink) frame(ctx context.Context, method byte, in proto.Message) ([]byte, error) {
	body, err := proto.Marshal(in)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	token := ""
	if l.token != nil {
		metadata, err := l.token.GetRequestMetadata(ctx)
		if err != nil {
			return nil, err
		}
		token = strings.TrimPrefix(metadata["authorization"], "Bearer ")
	}
	if len(token) > linkMaxToken {
		return nil, errLinkUnavailable
	}
	timeoutMs := uint64(0)
	if deadline, ok := ctx.Deadline(); ok {
		timeoutMs = min(uint64(max(time.Until(deadline).Milliseconds(), 1)), linkMaxTimeoutMs)
	}
	length := 1 + linkCallHead + len(token) + len(body)
	if length > linkMaxCallBytes {
		return nil, errLinkUnavailable
	}
	frame := make([]byte, 0, 4+length)
	frame = binary.BigEndian.AppendUint32(frame, uint32(length))
	frame = append(frame, linkKindCall, method)
	frame = binary.BigEndian.AppendUint32(frame, uint32(timeoutMs))
	frame = binary.BigEndian.AppendUint16(frame, uint16(len(token)))
	frame = append(frame, token...)
	return append(frame, body...), nil
}

// decodeAnswer is an answer frame decoded into out, or the error the gRPC call would
// have returned (err, when the call failed before an answer came).
func decodeAnswer(address string, kind byte, payload []byte, err error, out proto.Message) error {
	if err != nil {
		return err
	}
	if kind == linkKindError {
		item := &pb.ItemError{}
		if err := proto.Unmarshal(payload, item); err != nil {
			return status.Error(codes.Internal, fmt.Sprintf("a malformed error frame from %s", address))
		}
		return statusOf(item.GetReason(), item.GetMessage(), item.GetMetadata())
	}
	if err := proto.Unmarshal(payload, out); err != nil {
		return status.Error(codes.Internal, fmt.Sprintf("a malformed answer from %s: %v", address, err))
	}
	return nil
}

// exchange writes the frame and reads the answer frame: (kind, payload).
func exchange(conn net.Conn, frame []byte) (byte, []byte, error) {
	if _, err := conn.Write(frame); err != nil {
		return 0, nil, err
	}
	return readAnswer(conn)
}

// statusOf is the gRPC status error a server answers for an atomlog refusal: the
// reason's code (docs/errors.md) and its ErrorInfo.
func statusOf(reason, message string, metadata map[string]string) error {
	code := codes.Unknown
	if info, ok := reasons[reason]; ok {
		code = info.code
	}
	st, err := status.New(code, message).WithDetails(&errdetails.ErrorInfo{
		Reason: reason, Domain: Domain, Metadata: metadata})
	if err != nil {
		return status.Error(code, message)
	}
	return st.Err()
}

// take returns a kept connection (false) or a new one (true). A kept one idle too long,
// or that the server closed meanwhile (a restart, its idle limit), is closed here
// instead of failing a call. With linkMaxConns connections open (all in use) the call
// goes over gRPC (errLinkUnavailable), as the Python SDK's: without a bound, a client
// with hundreds of calls at once (long polls) filled the server's link, whose
// connection limit is for every client and server together.
func (l *serverLink) take(ctx context.Context) (net.Conn, bool, error) {
	now := time.Now()
	l.mu.Lock()
	for len(l.idle) > 0 {
		kept := l.idle[len(l.idle)-1]
		l.idle = l.idle[:len(l.idle)-1]
		if now.Sub(kept.used) < linkIdle {
			l.mu.Unlock()
			if open(kept.conn) {
				return kept.conn, false, nil
			}
			l.drop(kept.conn)
			l.mu.Lock()
			continue
		}
		kept.conn.Close()
		l.open--
	}
	if l.open >= linkMaxConns {
		l.mu.Unlock()
		return nil, false, errLinkUnavailable
	}
	l.open++
	l.connects++
	l.mu.Unlock()
	conn, err := l.connect(ctx, linkMagic)
	if err != nil {
		l.mu.Lock()
		l.open--
		l.mu.Unlock()
		l.markDown()
		return nil, true, errLinkUnavailable
	}
	return conn, true, nil
}

// drop closes a connection taken by take (not kept).
func (l *serverLink) drop(conn net.Conn) {
	conn.Close()
	l.mu.Lock()
	l.open--
	l.mu.Unlock()
}

// connect makes a connection to the link and sends `magic` (linkMagic: one call at a
// time; linkMagicPipelined: pipeline.go).
func (l *serverLink) connect(ctx context.Context, magic string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, linkConnectTimeout)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", l.address) // TCP_NODELAY by default
	if err != nil {
		return nil, err
	}
	if l.tls != nil {
		secured := tls.Client(conn, l.tls)
		if err := secured.HandshakeContext(ctx); err != nil {
			conn.Close()
			return nil, err
		}
		conn = secured
	}
	if _, err := conn.Write([]byte(magic)); err != nil {
		conn.Close()
		return nil, err
	}
	return conn, nil
}

func (l *serverLink) giveBack(conn net.Conn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || len(l.idle) >= linkMaxIdle {
		conn.Close()
		l.open--
		return
	}
	l.idle = append(l.idle, linkConn{conn: conn, used: time.Now()})
}

func (l *serverLink) markDown() {
	l.mu.Lock()
	l.downUntil = time.Now().Add(linkRetryAfter)
	l.mu.Unlock()
}

func (l *serverLink) isDown() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed || time.Now().Before(l.downUntil)
}

// pipelined is the link's pipelined connection (pipeline.go), made when first asked for.
func (l *serverLink) pipelined() *pipeline {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.pipe == nil {
		l.pipe = newPipeline(l)
	}
	return l.pipe
}

func (l *serverLink) close() {
	l.mu.Lock()
	l.closed = true
	for _, kept := range l.idle {
		kept.conn.Close()
	}
	l.open -= len(l.idle)
	l.idle = nil
	pipe := l.pipe
	l.mu.Unlock()
	if pipe != nil {
		pipe.close()
	}
}

// linkedConn is a server's gRPC connection whose unary calls the link carries go on the
// link (over gRPC while it cannot be reached); every other call goes over gRPC.
// pb.NewCoordinatorServiceClient and pb.NewPartitionServiceClient take it as they take
// the connection itself.
type linkedConn struct {
	*grpc.ClientConn
	link *serverLink
}

func (c linkedConn) Invoke(ctx context.Context, method string, in, out any,
	opts ...grpc.CallOption) error {
	number, carried := linkMethods[method]
	request, isRequest := in.(proto.Message)
	response, isResponse := out.(proto.Message)
	if carried && isRequest && isResponse {
		err := c.link.call(ctx, number, request, response)
		if !errors.Is(err, errLinkUnavailable) {
			return err
		}
	}
	return c.ClientConn.Invoke(ctx, method, in, out, opts...)
}
