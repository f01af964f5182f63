package atomlog

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// fakePipelinedLink takes pipelined connections (or, `old`, closes each once its magic
// came, as a server from before pipelining does) and answers a connection's frames
// only once `batch` of them have come, in order, each with its base offset.
func fakePipelinedLink(t *testing.T, batch int, old bool) string {
	if old {
		return fakeListener(t, linkMagicPipelined, nil)
	}
	return fakeListener(t, linkMagicPipelined, func(conn net.Conn) {
		for offset := int64(0); ; {
			var answers []byte
			for i := 0; i < batch; i++ {
				frame, err := readCallFrame(conn)
				if err != nil || frame[0] != linkProduce {
					return
				}
				payload, _ := proto.Marshal(&pb.ProduceResponse{Results: []*pb.ProduceResult{
					{BaseOffset: offset}}})
				offset++
				answers = binary.BigEndian.AppendUint32(answers, uint32(len(payload)+1))
				answers = append(append(answers, linkKindAnswer), payload...)
			}
			conn.Write(answers)
		}
	})
}

// Calls on a pipeline are sent without waiting for answers (the fake answers only once
// four have come) and their answers come back to each call in order, on one connection.
func TestPipelineSendsAheadAndAnswersInOrder(t *testing.T) {
	address := fakePipelinedLink(t, 4, false)
	var calls atomic.Int64
	link := newServerLink(address, address, nil, nil, &calls)
	defer link.close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var started []*pipelinedCall
	for i := 0; i < 8; i++ {
		call, err := link.pipelined().start(ctx, linkProduce, &pb.ProduceRequest{})
		if err != nil {
			t.Fatal(err)
		}
		started = append(started, call)
	}
	for i, call := range started {
		reply := &pb.ProduceResponse{}
		if err := call.wait(address, reply); err != nil || reply.GetResults()[0].GetBaseOffset() != int64(i) {
			t.Fatalf("call %d: %v %v", i, reply, err)
		}
	}
	if p := link.pipelined(); p.connects != 1 || p.most < 4 || calls.Load() != 8 {
		t.Fatalf("connects %d, most unanswered %d, calls %d", p.connects, p.most, calls.Load())
	}
}

// A server that closes a pipelined connection before any answer (one from before
// pipelining): the call fails SERVER_UNAVAILABLE (its outcome unknown: the producer
// resends) and the next ones go over gRPC for a while; a link that cannot be reached
// sends at once over gRPC.
func TestPipelineToAnOlderOrUnreachableServerFallsBackToGRPC(t *testing.T) {
	old := fakePipelinedLink(t, 1, true)
	var calls atomic.Int64
	link := newServerLink(old, old, nil, nil, &calls)
	defer link.close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	call, err := link.pipelined().start(ctx, linkProduce, &pb.ProduceRequest{})
	if err != nil {
		t.Fatal(err)
	}
	err = fromRPC(ctx, call.wait(old, &pb.ProduceResponse{}))
	var typed *Error
	if !errors.As(err, &typed) || typed.Reason != "SERVER_UNAVAILABLE" {
		t.Fatalf("a closed connection: %v", err)
	}
	if _, err := link.pipelined().start(ctx, linkProduce, &pb.ProduceRequest{}); !errors.Is(err, errLinkUnavailable) {
		t.Fatalf("after a connection closed before any answer: %v", err)
	}
	nowhere, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	address := nowhere.Addr().String()
	nowhere.Close()
	unreachable := newServerLink(address, address, nil, nil, &calls)
	if _, err := unreachable.pipelined().start(ctx, linkProduce, &pb.ProduceRequest{}); !errors.Is(err, errLinkUnavailable) {
		t.Fatalf("an unreachable link: %v", err)
	}
	if calls.Load() != 0 {
		t.Fatalf("%d calls answered on links", calls.Load())
	}
}
