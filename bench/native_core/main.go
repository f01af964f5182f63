// A measuring prototype, not part of atomlog: how fast could one-call transactions be
// with the server's hot path out of Python? bench/native_core.py drives it and the real
// combined server with the same Python clients and the same CommitTxn requests.
//
// It serves CoordinatorService/CommitTxn only (every other method is UNIMPLEMENTED), over
// gRPC and as call frames on a link (link.go), with
// the durable work a one-call transaction needs on a combined server, and nothing else:
//
//   - checks the request as the coordinator does: an idempotency key of 1-256 bytes whose
//     tc_partition_for is tc_partition, 1..64 batches, at most one per partition, 1 MiB in
//     all, each batch whole, its CRC32C right, not transactional, not a control batch,
//     without a producer id or sequence (INVALID_ARGUMENT otherwise, nothing written);
//   - a key it committed already answers already_ended (the last 100,000 keys);
//   - group commit in one goroutine: whatever queued while the last group was on disk
//     goes together. Phase 1 appends each partition's batches (offset, append time and
//     the transaction's id and bit stamped into the copy, its CRC computed again, as a
//     partition server stages them) and the previous group's commit markers (control
//     batches), then fsyncs every file it wrote, in parallel; phase 2 appends the
//     group's decisions to its TC partitions' logs and fsyncs them. Only then are the
//     calls answered: staged data durable before the decision, the decision durable
//     before the answer, markers after it, as the combined server does.
//
// What it does not do, and the real server does: replication, producer state and
// idempotent producers, transaction buffers and the max read position, acks and
// cursors, sessions and fencing, snapshots, recovery, retention, metrics, TLS, the
// ErrorInfo of a refusal. It holds no more than a hot path needs, so its figures are a
// ceiling for a native core, not a promise.
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"hash/crc32"
	"log"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/atomlog/atomlog/clients/go/atomlog"
	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

const (
	tcPartitions   = 16
	maxKeyBytes    = 256
	maxOneCall     = 1 << 20
	maxBatches     = 64
	rememberedKeys = 100_000
)

// A commit marker's key and value (docs/record-format.md: version 0, type 1 = COMMIT;
// version 0, coordinator epoch 0).
var markerKey, markerValue = []byte{0, 0, 0, 1}, []byte{0, 0, 0, 0, 0, 0}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

type partitionLog struct {
	file *os.File
	next int64
}

type pending struct {
	request *pb.CommitTxnRequest
	headers []atomlog.Header
	done    chan answer
}

type answer struct {
	response *pb.CommitTxnResponse
	err      error
}

type server struct {
	pb.UnimplementedCoordinatorServiceServer
	dir      string
	queue    chan *pending
	logs     map[string]*partitionLog // the committer goroutine's alone
	tcLogs   [tcPartitions]*partitionLog
	sequence [tcPartitions]uint64
	keys     map[string]*pb.TxnId
	order    []string
	markers  map[*partitionLog][]*pb.TxnId // markers owed by the last group, per log
	// --wal: a group's staged batches, markers and decisions go to one write-ahead file
	// with one fsync; the partition files get them later, many groups at a time
	// (checkpointer).
	wal         *os.File
	checkpoint  map[*partitionLog][]byte
	checkpoints sync.Mutex
}

func (s *server) CommitTxn(ctx context.Context, request *pb.CommitTxnRequest) (*pb.CommitTxnResponse, error) {
	headers, err := check(request)
	if err != nil {
		return nil, err
	}
	p := &pending{request: request, headers: headers, done: make(chan answer, 1)}
	select {
	case s.queue <- p:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	a := <-p.done // once queued, the outcome is the group's: never answered early
	return a.response, a.err
}

func check(request *pb.CommitTxnRequest) ([]atomlog.Header, error) {
	key := request.GetIdempotencyKey()
	if len(key) == 0 || len(key) > maxKeyBytes {
		return nil, status.Errorf(codes.InvalidArgument, "idempotency_key must be 1-%d bytes", maxKeyBytes)
	}
	if want := crc32.Checksum([]byte(key), castagnoli) % tcPartitions; request.GetTcPartition() != want {
		return nil, status.Errorf(codes.InvalidArgument, "tc_partition %d is not tc_partition_for(key) %d",
			request.GetTcPartition(), want)
	}
	if request.GetAbort() || len(request.GetAcks()) > 0 || request.GetSession() != nil {
		return nil, status.Error(codes.Unimplemented, "the prototype commits batches only")
	}
	batches := request.GetBatches()
	if len(batches) == 0 || len(batches) > maxBatches {
		return nil, status.Errorf(codes.InvalidArgument, "1-%d batches", maxBatches)
	}
	seen := make(map[string]bool, len(batches))
	headers := make([]atomlog.Header, len(batches))
	total := 0
	for i, item := range batches {
		name := partitionName(item.GetTopicPartition())
		if seen[name] {
			return nil, status.Errorf(codes.InvalidArgument, "two batches for %s", name)
		}
		seen[name] = true
		batch := item.GetRecordBatch()
		total += len(batch)
		h, err := atomlog.ParseHeader(batch)
		if err == nil && h.Size() != len(batch) {
			err = fmt.Errorf("batch_length says %d bytes, the batch has %d", h.Size(), len(batch))
		}
		if err == nil {
			err = atomlog.VerifyCRC(batch, h)
		}
		if err == nil && (h.IsTransactional() || h.IsControl() || h.ProducerID != 0 || h.BaseSequence != -1) {
			err = fmt.Errorf("a one-call batch has no producer id, no sequence and no transaction")
		}
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "%s: %v", name, err)
		}
		headers[i] = h
	}
	if total > maxOneCall {
		return nil, status.Errorf(codes.InvalidArgument, "%d bytes of batches, above %d", total, maxOneCall)
	}
	return headers, nil
}

func partitionName(tp *pb.TopicPartition) string {
	return fmt.Sprintf("%s-%d", tp.GetTopic(), tp.GetPartition())
}

func (s *server) partition(name string) (*partitionLog, error) {
	if l, ok := s.logs[name]; ok {
		return l, nil
	}
	f, err := os.OpenFile(filepath.Join(s.dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	l := &partitionLog{file: f}
	s.logs[name] = l
	return l, nil
}

// committer runs the groups, one at a time: what queues meanwhile is the next group.
func (s *server) committer() {
	for {
		var group []*pending
		if len(s.markers) > 0 {
			select {
			case p := <-s.queue:
				group = append(group, p)
			default: // idle with markers owed: write them now
			}
		} else {
			group = append(group, <-s.queue)
		}
	drain:
		for {
			select {
			case p := <-s.queue:
				group = append(group, p)
			default:
				break drain
			}
		}
		s.commit(group)
	}
}

func (s *server) commit(group []*pending) {
	now := time.Now().UnixMilli()
	var fresh, again []*pending
	inGroup := map[string]bool{}
	for _, p := range group {
		key := p.request.GetIdempotencyKey()
		if id, ok := s.keys[key]; ok {
			p.done <- answer{response: &pb.CommitTxnResponse{TxnId: id,
				State: pb.TxnState_TXN_STATE_COMMITTING, AlreadyEnded: true}}
			continue
		}
		if inGroup[key] { // a retry racing its first call: answered once that one is
			again = append(again, p)
			continue
		}
		inGroup[key] = true
		fresh = append(fresh, p)
	}
	defer func() {
		for _, p := range again {
			if id, ok := s.keys[p.request.GetIdempotencyKey()]; ok {
				p.done <- answer{response: &pb.CommitTxnResponse{TxnId: id,
					State: pb.TxnState_TXN_STATE_COMMITTING, AlreadyEnded: true}}
			} else {
				p.done <- answer{err: status.Error(codes.Unavailable, "its first call failed")}
			}
		}
	}()
	// Phase 1: the staged batches and the previous group's markers, each log's in one
	// write, then every written log's fsync in parallel.
	buffers := map[*partitionLog][]byte{}
	for l, ids := range s.markers {
		for _, id := range ids {
			buffers[l] = append(buffers[l], marker(id, l.next, now)...)
			l.next++
		}
	}
	s.markers = map[*partitionLog][]*pb.TxnId{}
	owed := make([][]*partitionLog, len(fresh)) // the logs each transaction wrote
	results := make([][]*pb.ProduceResult, len(fresh))
	ids := make([]*pb.TxnId, len(fresh))
	var failed error
	for i, p := range fresh {
		tc := p.request.GetTcPartition()
		s.sequence[tc]++
		ids[i] = &pb.TxnId{TcPartition: tc, Sequence: s.sequence[tc]}
		for j, item := range p.request.GetBatches() {
			l, err := s.partition(partitionName(item.GetTopicPartition()))
			if err != nil {
				failed = err
				break
			}
			batch := item.GetRecordBatch()
			start := len(buffers[l])
			buffers[l] = append(buffers[l], batch...)
			// As a partition server stages it: the offset, the append time, the
			// transaction's id and bit, and the CRC again.
			stamped := buffers[l][start:]
			binary.BigEndian.PutUint64(stamped[0:], uint64(l.next))
			binary.BigEndian.PutUint64(stamped[13:], uint64(now))
			binary.BigEndian.PutUint16(stamped[25:], binary.BigEndian.Uint16(stamped[25:])|0x10)
			binary.BigEndian.PutUint32(stamped[65:], ids[i].TcPartition)
			binary.BigEndian.PutUint64(stamped[69:], ids[i].Sequence)
			binary.BigEndian.PutUint32(stamped[21:], crc32.Checksum(stamped[25:], castagnoli))
			h := p.headers[j]
			results[i] = append(results[i], &pb.ProduceResult{
				TopicPartition: item.GetTopicPartition(), BaseOffset: l.next,
				LastOffset: l.next + int64(h.LastOffsetDelta), LogAppendTimeUnixMs: now})
			l.next += int64(h.LastOffsetDelta) + 1
			owed[i] = append(owed[i], l)
		}
	}
	var walGroup []byte
	if failed == nil && s.wal != nil {
		walGroup = s.frames(buffers)
	} else if failed == nil {
		failed = writeAndSync(buffers)
	}
	// Phase 2: the decisions, each TC partition's log in one write, then their fsyncs.
	if failed == nil {
		decisions := map[*partitionLog][]byte{}
		for i, p := range fresh {
			l := s.tcLogs[p.request.GetTcPartition()]
			decisions[l] = append(decisions[l], decision(ids[i], p.request.GetIdempotencyKey(), now)...)
		}
		if s.wal != nil {
			// One file, written in order and read back as its longest valid prefix (each
			// frame has its CRC): a decision that survives a crash has its data before it.
			walGroup = append(walGroup, s.frames(decisions)...)
			if _, failed = s.wal.Write(walGroup); failed == nil {
				failed = s.wal.Sync()
			}
			if failed == nil {
				s.checkpoints.Lock()
				for _, written := range []map[*partitionLog][]byte{buffers, decisions} {
					for l, data := range written {
						s.checkpoint[l] = append(s.checkpoint[l], data...)
					}
				}
				s.checkpoints.Unlock()
			}
		} else {
			failed = writeAndSync(decisions)
		}
		if failed == nil {
			for i, p := range fresh {
				s.remember(p.request.GetIdempotencyKey(), ids[i])
				for _, l := range owed[i] {
					s.markers[l] = append(s.markers[l], ids[i])
				}
				p.done <- answer{response: &pb.CommitTxnResponse{TxnId: ids[i],
					State: pb.TxnState_TXN_STATE_COMMITTING, BatchResults: results[i]}}
			}
			return
		}
	}
	// A failed write or fsync: the outcome of this group is unknown, and so is the page
	// cache; a real server would reload from disk. The prototype stops.
	for _, p := range fresh {
		p.done <- answer{err: status.Errorf(codes.Unavailable, "disk: %v", failed)}
	}
	log.Fatalf("native core: %v", failed)
}

// frames is the write-ahead file's form of per-log data: for each log, its file's name,
// the data's length, the data and a CRC32C of all three.
func (s *server) frames(buffers map[*partitionLog][]byte) []byte {
	var out []byte
	for l, data := range buffers {
		start := len(out)
		name := filepath.Base(l.file.Name())
		out = binary.BigEndian.AppendUint16(out, uint16(len(name)))
		out = append(out, name...)
		out = binary.BigEndian.AppendUint32(out, uint32(len(data)))
		out = append(out, data...)
		out = binary.BigEndian.AppendUint32(out, crc32.Checksum(out[start:], castagnoli))
	}
	return out
}

// checkpointer copies what the write-ahead file made durable into the partition files,
// every 100 ms, one write and one fsync per file for all the groups since (the cost a
// write-ahead design moves off the commit path; a real one would then trim the file).
func (s *server) checkpointer() {
	for range time.Tick(100 * time.Millisecond) {
		s.checkpoints.Lock()
		due := s.checkpoint
		s.checkpoint = map[*partitionLog][]byte{}
		s.checkpoints.Unlock()
		if err := writeAndSync(due); err != nil {
			log.Fatalf("native core: checkpoint: %v", err)
		}
	}
}

func writeAndSync(buffers map[*partitionLog][]byte) error {
	var wg sync.WaitGroup
	errs := make(chan error, len(buffers))
	for l, data := range buffers {
		if _, err := l.file.Write(data); err != nil {
			return err
		}
		wg.Add(1)
		go func(f *os.File) {
			defer wg.Done()
			if err := f.Sync(); err != nil {
				errs <- err
			}
		}(l.file)
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// marker is the commit marker of transaction id at offset: a control batch of one record.
func marker(id *pb.TxnId, offset, now int64) []byte {
	b, err := atomlog.EncodeRowBatch([]atomlog.Record{{Key: markerKey, Value: markerValue,
		Timestamp: time.UnixMilli(now)}}, atomlog.BatchFields{BaseSequence: atomlog.NoSequence,
		Txn: atomlog.TxnID{TCPartition: id.TcPartition, Sequence: id.Sequence}})
	if err != nil {
		log.Fatalf("native core: a marker: %v", err)
	}
	binary.BigEndian.PutUint64(b[0:], uint64(offset))
	binary.BigEndian.PutUint64(b[13:], uint64(now))
	binary.BigEndian.PutUint16(b[25:], binary.BigEndian.Uint16(b[25:])|0x20) // control
	binary.BigEndian.PutUint32(b[21:], crc32.Checksum(b[25:], castagnoli))
	return b
}

func decision(id *pb.TxnId, key string, now int64) []byte {
	b := binary.BigEndian.AppendUint64(nil, id.Sequence)
	b = binary.BigEndian.AppendUint64(b, uint64(now))
	b = binary.BigEndian.AppendUint16(b, uint16(len(key)))
	b = append(b, key...)
	return binary.BigEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
}

func (s *server) remember(key string, id *pb.TxnId) {
	s.keys[key] = id
	s.order = append(s.order, key)
	if len(s.order) > rememberedKeys {
		delete(s.keys, s.order[0])
		s.order = s.order[1:]
	}
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "gRPC address")
	linkListen := flag.String("link-listen", "127.0.0.1:0", "link address (link.go)")
	dir := flag.String("dir", "", "data directory (required)")
	wal := flag.Bool("wal", false, "one write-ahead file per server, one fsync per group")
	flag.Parse()
	if *dir == "" {
		log.Fatal("--dir is required")
	}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		log.Fatal(err)
	}
	s := &server{dir: *dir, queue: make(chan *pending, 4096), logs: map[string]*partitionLog{},
		keys: map[string]*pb.TxnId{}, markers: map[*partitionLog][]*pb.TxnId{}}
	for tc := range s.tcLogs {
		f, err := os.OpenFile(filepath.Join(*dir, fmt.Sprintf("__tc-%d.log", tc)),
			os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			log.Fatal(err)
		}
		s.tcLogs[tc] = &partitionLog{file: f}
	}
	if *wal {
		f, err := os.OpenFile(filepath.Join(*dir, "wal.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			log.Fatal(err)
		}
		s.wal, s.checkpoint = f, map[*partitionLog][]byte{}
		go s.checkpointer()
	}
	listener, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	linkListener, err := net.Listen("tcp", *linkListen)
	if err != nil {
		log.Fatal(err)
	}
	grpcServer := grpc.NewServer()
	pb.RegisterCoordinatorServiceServer(grpcServer, s)
	go s.committer()
	go s.serveLink(linkListener)
	// The driver reads the ports from here: the gRPC address, then the link's.
	fmt.Println(listener.Addr().String(), linkListener.Addr().String())
	if err := grpcServer.Serve(listener); err != nil {
		log.Fatal(err)
	}
}
