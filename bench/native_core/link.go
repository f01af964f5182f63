package main

// The link (services/link_wire.py, docs/clients.md "The link"): the same CommitTxn as
// call frames on a plain TCP connection, one call at a time, as the SDK's commits reach
// a coordinator, so bench/native_core.py can drive this prototype with the clients it
// drives the combined server's link with. A goroutine per connection; the call goes to
// the same CommitTxn (checks, group commit) as over gRPC. A refusal is an error frame
// (an ItemError of the status's reason); a frame that is not a call, or that passes
// link_wire.MAX_CALL_BYTES, closes the connection, as the link server does.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"strings"

	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

var linkMagic = []byte("ATLNK\x00\x00\x01")

const (
	kindAnswer      = 0
	kindError       = 2
	kindCall        = 3
	commitTxnMethod = 4 // link_wire.CALL_METHODS
	maxCallBytes    = 64 << 20
	callHeadBytes   = 7 // u8 method, u32 timeout ms, u16 token length
)

func (s *server) serveLink(listener net.Listener) {
	for {
		conn, err := listener.Accept()
		if err != nil {
			return
		}
		go s.link(conn)
	}
}

func (s *server) link(conn net.Conn) {
	defer conn.Close()
	if tcp, ok := conn.(*net.TCPConn); ok {
		tcp.SetNoDelay(true)
	}
	r := bufio.NewReaderSize(conn, 64<<10)
	magic := make([]byte, len(linkMagic))
	if _, err := io.ReadFull(r, magic); err != nil || !bytes.Equal(magic, linkMagic) {
		return
	}
	head := make([]byte, 5)
	for {
		if _, err := io.ReadFull(r, head); err != nil {
			return
		}
		length := binary.BigEndian.Uint32(head[:4])
		if length < 1 || length-1 > maxCallBytes || head[4] != kindCall {
			return
		}
		body := make([]byte, length-1)
		if _, err := io.ReadFull(r, body); err != nil {
			return
		}
		kind, payload := s.linkCall(body)
		out := make([]byte, 5+len(payload))
		binary.BigEndian.PutUint32(out, uint32(1+len(payload)))
		out[4] = kind
		copy(out[5:], payload)
		if _, err := conn.Write(out); err != nil {
			return
		}
	}
}

// linkCall answers one call frame's body: (kind, payload).
func (s *server) linkCall(body []byte) (byte, []byte) {
	if len(body) < callHeadBytes {
		return linkError("INVALID_ARGUMENT", "the call frame is shorter than its head")
	}
	if body[0] != commitTxnMethod {
		return linkError("UNIMPLEMENTED", "the prototype serves CommitTxn only")
	}
	tokenEnd := callHeadBytes + int(binary.BigEndian.Uint16(body[5:7]))
	if tokenEnd > len(body) {
		return linkError("INVALID_ARGUMENT", "the call's token runs past its frame")
	}
	request := &pb.CommitTxnRequest{}
	if err := proto.Unmarshal(body[tokenEnd:], request); err != nil {
		return linkError("INVALID_ARGUMENT", "the request is not a CommitTxnRequest")
	}
	response, err := s.CommitTxn(context.Background(), request)
	if err != nil {
		refusal := status.Convert(err)
		return linkError(reason(refusal.Code().String()), refusal.Message())
	}
	data, err := proto.Marshal(response)
	if err != nil {
		return linkError("INTERNAL", err.Error())
	}
	return kindAnswer, data
}

func linkError(reason, message string) (byte, []byte) {
	data, _ := proto.Marshal(&pb.ItemError{Reason: reason, Message: message})
	return kindError, data
}

// reason is a status code's name as atomlog's reasons spell it: InvalidArgument ->
// INVALID_ARGUMENT.
func reason(code string) string {
	var b strings.Builder
	for i, c := range code {
		if i > 0 && c >= 'A' && c <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(c)
	}
	return strings.ToUpper(b.String())
}
