package atomlog

// A producer's Produce calls on one pipelined connection to each partition server's link
// (services/link_wire.py, MAGIC_PIPELINED): the producer writes its calls' frames in the
// order it sends them, up to linkMaxPipelined unanswered, and a reader goroutine takes
// the answers, which the server gives in the same order. The server starts each call as
// its frame arrives, so a partition's batches reach it in sequence order, as on one
// gRPC connection (calls on several connections could overtake one another and be
// refused as out of order).
//
// Failures: a connection that cannot be made, or that the server closes before any
// answer (a server from before pipelining closes it at once), is errLinkUnavailable: the
// call goes over gRPC, and so do the next linkRetryAfter of them. A connection lost
// later fails every unanswered call SERVER_UNAVAILABLE (the outcome unknown: the
// producer resends, and sequence numbers make the resend of a written batch harmless).
// An answer not come linkLateAnswer after its call's deadline fails the unanswered calls
// REQUEST_TIMED_OUT and closes the connection.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

const (
	linkMagicPipelined = "ATLNK\x00\x00\x02"
	linkMaxPipelined   = 8 // frames unanswered on a pipelined connection (link_wire.MAX_PIPELINED)
	linkLateAnswer     = 2 * time.Second
	linkProduce        = byte(2) // PartitionService.Produce's number on the wire
)

// pipeline is one pipelined connection to a server's link; start is safe for
// concurrent use.
type pipeline struct {
	link     *serverLink
	sendMu   sync.Mutex // one start at a time: frames are written in `pending` order
	mu       sync.Mutex // what follows
	room     *sync.Cond
	conn     net.Conn
	answered bool // whether conn answered anything yet
	pending  []*pipelinedCall
	most     int // the most calls unanswered at once (tests)
	connects int
	closed   bool
}

// pipelinedCall is one call under way: its answer comes on done (buffered, once).
type pipelinedCall struct {
	deadline time.Time
	done     chan linkAnswer
}

type linkAnswer struct {
	kind    byte
	payload []byte
	err     error
}

func newPipeline(link *serverLink) *pipeline {
	p := &pipeline{link: link}
	p.room = sync.NewCond(&p.mu)
	return p
}

// start writes the call frame of `method` with `in` (its deadline ctx's); errLinkUnavailable
// when nothing was sent (send it over gRPC).
func (p *pipeline) start(ctx context.Context, method byte, in proto.Message) (*pipelinedCall, error) {
	frame, err := p.link.frame(ctx, method, in)
	if err != nil {
		return nil, err
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(time.Hour)
	}
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	for {
		p.mu.Lock()
		if p.closed || p.link.isDown() {
			p.mu.Unlock()
			return nil, errLinkUnavailable
		}
		for len(p.pending) >= linkMaxPipelined && p.conn != nil {
			p.room.Wait()
		}
		if conn := p.conn; conn != nil {
			call := &pipelinedCall{deadline: deadline, done: make(chan linkAnswer, 1)}
			p.pending = append(p.pending, call)
			p.most = max(p.most, len(p.pending))
			if len(p.pending) == 1 { // the reader waits for it, not for the idle limit
				conn.SetReadDeadline(deadline.Add(linkLateAnswer))
			}
			p.mu.Unlock()
			conn.SetWriteDeadline(deadline)
			if _, err := conn.Write(frame); err != nil {
				p.lost(conn, err) // (this call fails with the others)
			}
			return call, nil
		}
		p.connects++
		p.mu.Unlock()
		conn, err := p.link.connect(ctx, linkMagicPipelined)
		if err != nil {
			p.link.markDown()
			return nil, errLinkUnavailable
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			conn.Close()
			return nil, errLinkUnavailable
		}
		p.conn, p.answered = conn, false
		p.mu.Unlock()
		go p.read(conn)
	}
}

// read takes conn's answers in order until it is lost or replaced, or idle for linkIdle
// (then it closes it).
func (p *pipeline) read(conn net.Conn) {
	for {
		p.mu.Lock()
		if p.conn != conn {
			p.mu.Unlock()
			return
		}
		if len(p.pending) == 0 {
			conn.SetReadDeadline(time.Now().Add(linkIdle))
		} else {
			conn.SetReadDeadline(p.pending[0].deadline.Add(linkLateAnswer))
		}
		p.mu.Unlock()
		kind, payload, err := readAnswer(conn)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				p.mu.Lock()
				idle := p.conn == conn && len(p.pending) == 0
				late := p.conn == conn && len(p.pending) > 0 &&
					time.Now().After(p.pending[0].deadline.Add(linkLateAnswer))
				if idle {
					p.conn = nil
				}
				p.mu.Unlock()
				if idle {
					conn.Close()
					return
				}
				if !late {
					continue // a call came while the idle limit was set
				}
			}
			p.lost(conn, err)
			return
		}
		p.mu.Lock()
		if p.conn != conn || len(p.pending) == 0 {
			p.mu.Unlock()
			p.lost(conn, fmt.Errorf("an answer with no call under way"))
			return
		}
		call := p.pending[0]
		p.pending = p.pending[1:]
		p.answered = true
		p.room.Broadcast()
		p.mu.Unlock()
		p.link.calls.Add(1)
		call.done <- linkAnswer{kind: kind, payload: payload}
	}
}

// lost: conn is gone, and every call unanswered on it fails (its outcome unknown).
func (p *pipeline) lost(conn net.Conn, cause error) {
	p.mu.Lock()
	if p.conn != conn {
		p.mu.Unlock()
		return
	}
	p.conn = nil
	failed := p.pending
	p.pending = nil
	neverAnswered := !p.answered && !p.closed
	p.room.Broadcast()
	p.mu.Unlock()
	conn.Close()
	if neverAnswered {
		p.link.markDown() // a server from before pipelining: gRPC for a while
	}
	var err error
	if errors.Is(cause, os.ErrDeadlineExceeded) {
		err = statusOf("REQUEST_TIMED_OUT", fmt.Sprintf("Produce to %s (link) took longer "+
			"than its deadline", p.link.address), nil)
	} else {
		err = statusOf("SERVER_UNAVAILABLE", fmt.Sprintf("Produce to %s (link): %v",
			p.link.address, cause), map[string]string{"retry_after_ms": "50"})
	}
	for _, call := range failed {
		call.done <- linkAnswer{err: err}
	}
}

func (p *pipeline) close() {
	p.mu.Lock()
	p.closed = true
	conn := p.conn
	p.mu.Unlock()
	if conn != nil {
		p.lost(conn, errors.New("the client closed"))
	}
}

// wait is the call's answer decoded into out, or the error the gRPC call would return.
func (c *pipelinedCall) wait(address string, out proto.Message) error {
	answer := <-c.done
	return decodeAnswer(address, answer.kind, answer.payload, answer.err, out)
}

// readAnswer reads one answer frame: (kind, payload).
func readAnswer(conn net.Conn) (byte, []byte, error) {
	var head [linkFrameHead]byte
	if _, err := io.ReadFull(conn, head[:]); err != nil {
		return 0, nil, err
	}
	length, kind := binary.BigEndian.Uint32(head[:4]), head[4]
	if (kind != linkKindAnswer && kind != linkKindError) || length < 1 || length > linkMaxCallBytes+1 {
		return 0, nil, fmt.Errorf("answer frame kind %d, %d bytes", kind, length)
	}
	payload := make([]byte, length-1)
	if _, err := io.ReadFull(conn, payload); err != nil {
		return 0, nil, err
	}
	return kind, payload, nil
}

// produceOn sends a Produce request on the pipeline to `address`'s link when it has
// one: (the call, true), or (nil, false) when it must go over gRPC.
func (c *Client) produceOn(address string, request *pb.ProduceRequest) (*pipelinedCall, bool) {
	link := c.link(address, false)
	if link == nil {
		return nil, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.RequestTimeout)
	defer cancel()
	call, err := link.pipelined().start(ctx, linkProduce, request)
	if err != nil {
		return nil, false
	}
	return call, true
}
