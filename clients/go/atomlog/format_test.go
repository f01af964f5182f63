package atomlog

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/ipc"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// repoRoot is the atomlog checkout this module lives in (clients/go/atomlog/..).
func repoRoot(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

func TestReasonsMatchDocs(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "errors.md"))
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `([A-Z_]+)` \\| ([A-Z_]+) \\| (retriable|abortable|fatal) \\|")
	outcomes := map[string]Outcome{"retriable": Retriable, "abortable": Abortable, "fatal": Fatal}
	seen := map[string]bool{}
	for _, m := range row.FindAllStringSubmatch(string(doc), -1) {
		reason, code, outcome := m[1], m[2], m[3]
		seen[reason] = true
		info, ok := reasons[reason]
		if !ok {
			t.Errorf("docs/errors.md has %s, the Go client does not", reason)
			continue
		}
		if info.outcome != outcomes[outcome] {
			t.Errorf("%s: docs say %s, the Go client %s", reason, outcome, info.outcome)
		}
		if got := strings.ToUpper(regexp.MustCompile("([a-z])([A-Z])").ReplaceAllString(info.code.String(), "${1}_${2}")); got != code {
			t.Errorf("%s: docs say code %s, the Go client %s", reason, code, got)
		}
	}
	if len(seen) < 40 {
		t.Fatalf("only %d reasons parsed from docs/errors.md", len(seen))
	}
	for reason := range reasons {
		if !seen[reason] {
			t.Errorf("the Go client has %s, docs/errors.md does not", reason)
		}
	}
}

func TestErrorFromStatusDetails(t *testing.T) {
	st, err := status.New(codes.FailedPrecondition, "not mine").WithDetails(&errdetails.ErrorInfo{
		Reason: ReasonNotPartitionOwner, Domain: Domain, Metadata: map[string]string{"owner_address": "x:1"}})
	if err != nil {
		t.Fatal(err)
	}
	got := fromRPC(context.Background(), st.Err())
	var e *Error
	if !errors.As(got, &e) || e.Reason != ReasonNotPartitionOwner || !e.Retriable() ||
		e.Metadata["owner_address"] != "x:1" || e.Code != codes.FailedPrecondition {
		t.Fatalf("got %#v", got)
	}
	if !errors.Is(got, ErrNotPartitionOwner) || errors.Is(got, ErrProducerFenced) {
		t.Fatal("errors.Is does not match by reason")
	}
	bare := fromRPC(context.Background(), status.Error(codes.Unavailable, "connection refused"))
	if Reason(bare) != ReasonServerUnavailable || !IsRetriable(bare) {
		t.Fatalf("a bare UNAVAILABLE is %v", bare)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if got := fromRPC(ctx, status.Error(codes.Canceled, "x")); !errors.Is(got, context.Canceled) {
		t.Fatalf("a cancelled call is %v", got)
	}
	if OutcomeOf(ReasonProducerFenced) != Fatal || OutcomeOf(ReasonTransactionAborted) != Abortable {
		t.Fatal("outcomes")
	}
}

func TestTCPartitionFor(t *testing.T) {
	if got := CRC32C([]byte("123456789")); got != 0xe3069283 { // the CRC-32C check value
		t.Fatalf("CRC32C = %08x", got)
	}
	// The same values as coordinator/records.py's tc_partition_for.
	if TCPartitionFor("copier-1", 16) != 7 || TCPartitionFor("sdk-x", 16) != 12 {
		t.Fatal("TCPartitionFor differs from the Python reference")
	}
}

func TestGatheringTCPartitionsAreEachCoordinatorsLowest(t *testing.T) {
	if got := gatheringTCPartitions(map[uint32]string{0: "", 1: ""}); len(got) != 0 {
		t.Fatalf("no owners: %v", got)
	}
	routes := map[uint32]string{5: "b:1", 3: "a:1", 9: "a:1", 0: "", 2: "c:1", 7: "b:1", 4: "c:1"}
	if got := fmt.Sprint(gatheringTCPartitions(routes)); got != "[2 3 5]" {
		t.Fatalf("gathering partitions %s, want [2 3 5]", got)
	}
	for tc := uint32(0); tc < 16; tc++ {
		if key := keyFor(tc, 16); TCPartitionFor(key, 16) != tc {
			t.Fatalf("keyFor(%d) = %q hashes to %d", tc, key, TCPartitionFor(key, 16))
		}
	}
}

func sampleRecords() []Record {
	base := time.UnixMilli(1_700_000_000_000)
	return []Record{
		{Key: []byte("k1"), Value: []byte("hello"), Timestamp: base,
			Headers: []RecordHeader{{Key: "trace", Value: []byte{0, 1, 2}}, {Key: "é", Value: []byte{}}}},
		{Key: nil, Value: nil, Timestamp: base.Add(5 * time.Millisecond)},
		{Key: []byte{}, Value: bytes.Repeat([]byte("v"), 3000), Timestamp: base.Add(-2 * time.Millisecond)},
	}
}

func sameRecords(t *testing.T, got, want []Record) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d records, want %d", len(got), len(want))
	}
	for i := range want {
		g, w := got[i], want[i]
		if !bytes.Equal(g.Key, w.Key) || (g.Key == nil) != (w.Key == nil) ||
			!bytes.Equal(g.Value, w.Value) || (g.Value == nil) != (w.Value == nil) ||
			!g.Timestamp.Equal(w.Timestamp) || len(g.Headers) != len(w.Headers) {
			t.Fatalf("record %d: got %+v, want %+v", i, g, w)
		}
		for j := range w.Headers {
			if g.Headers[j].Key != w.Headers[j].Key || !bytes.Equal(g.Headers[j].Value, w.Headers[j].Value) {
				t.Fatalf("record %d header %d: got %+v", i, j, g.Headers[j])
			}
		}
	}
}

func TestBatchesRoundTrip(t *testing.T) {
	records := sampleRecords()
	for _, compression := range []Compression{CompressionNone, CompressionZstd, CompressionLZ4} {
		fields := BatchFields{ProducerID: 42, ProducerEpoch: 3, BaseSequence: 10,
			Txn: TxnID{TCPartition: 5, Sequence: 9}, Compression: compression}
		for name, encode := range map[string]func([]Record, BatchFields) ([]byte, error){
			"rows": EncodeRowBatch, "columns": EncodeColumnBatch} {
			batch, err := encode(records, fields)
			if err != nil {
				t.Fatalf("%s %d: %v", name, compression, err)
			}
			h, got, err := DecodeBatch(batch)
			if err != nil {
				t.Fatalf("%s %d: %v", name, compression, err)
			}
			sameRecords(t, got, records)
			if h.ProducerID != 42 || h.ProducerEpoch != 3 || h.BaseSequence != 10 || !h.IsTransactional() ||
				h.TxnTCPartition != 5 || h.TxnSequence != 9 || h.Compression() != compression ||
				h.RecordCount != 3 || h.BaseTimestampMs != 1_700_000_000_000 ||
				h.MaxTimestampMs != 1_700_000_000_005 || h.LogAppendTimeMs != -1 {
				t.Fatalf("%s %d: header %+v", name, compression, h)
			}
			if wantMagic := map[string]int8{"rows": 1, "columns": 2}[name]; h.Magic != wantMagic {
				t.Fatalf("%s: magic %d", name, h.Magic)
			}
		}
	}
}

func TestDamageIsRefused(t *testing.T) {
	batch, err := EncodeColumnBatch(sampleRecords(), BatchFields{BaseSequence: NoSequence})
	if err != nil {
		t.Fatal(err)
	}
	for _, at := range []int{30, 80, len(batch) - 1} { // attributes-covered header byte, block, last byte
		damaged := bytes.Clone(batch)
		damaged[at] ^= 0x40
		if _, _, err := DecodeBatch(damaged); Reason(err) != ReasonCRCMismatch && Reason(err) != ReasonCorruptBatch {
			t.Fatalf("a flipped bit at %d: %v", at, err)
		}
	}
	// A consistent CRC over a block that is not one Arrow message of the schema.
	bad := frameBatch([]byte("not an arrow message at all...."), magicColumns, 1, 0, 0,
		BatchFields{BaseSequence: NoSequence})
	if _, _, err := DecodeBatch(bad); Reason(err) != ReasonCorruptBatch {
		t.Fatalf("garbage block: %v", err)
	}
	// Extra bytes after the Arrow message.
	h, _ := ParseHeader(batch)
	block := append(bytes.Clone(batch[headerSize:h.Size()]), make([]byte, 8)...)
	long := frameBatch(block, magicColumns, 3, h.BaseTimestampMs, h.MaxTimestampMs, BatchFields{BaseSequence: NoSequence})
	if _, _, err := DecodeBatch(long); Reason(err) != ReasonCorruptBatch || !strings.Contains(err.Error(), "after") {
		t.Fatalf("trailing bytes: %v", err)
	}
	// The wrong record count.
	short := frameBatch(batch[headerSize:h.Size()], magicColumns, 2, h.BaseTimestampMs, h.MaxTimestampMs,
		BatchFields{BaseSequence: NoSequence})
	if _, _, err := DecodeBatch(short); Reason(err) != ReasonCorruptBatch {
		t.Fatalf("record count: %v", err)
	}
	if _, err := ParseHeader(batch[:40]); Reason(err) != ReasonCorruptBatch {
		t.Fatalf("truncated header: %v", err)
	}
	if _, err := EncodeColumnBatch(sampleRecords(), BatchFields{}); Reason(err) != ReasonInvalidArgument {
		t.Fatalf("sequence 0 without a producer id: %v", err)
	}
}

// The schema message printed in docs/record-format.md §1.6 reads a block this client wrote.
func TestDocsSchemaMessageReadsOurBlocks(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "record-format.md"))
	if err != nil {
		t.Fatal(err)
	}
	section := string(doc)[strings.Index(string(doc), "these 424 bytes (hex)"):]
	hexText := section[strings.Index(section, "```")+3:]
	hexText = hexText[:strings.Index(hexText, "```")]
	stream, err := hex.DecodeString(strings.Join(strings.Fields(hexText), ""))
	if err != nil || len(stream) != 424 {
		t.Fatalf("the docs' schema message: %d bytes, %v", len(stream), err)
	}
	batch, err := EncodeColumnBatch(sampleRecords(), BatchFields{BaseSequence: NoSequence, Compression: CompressionZstd})
	if err != nil {
		t.Fatal(err)
	}
	h, _ := ParseHeader(batch)
	withBlock := append(append(bytes.Clone(stream[:len(stream)-8]), batch[headerSize:h.Size()]...), eos...)
	reader, err := ipc.NewReader(bytes.NewReader(withBlock), ipc.WithSchema(BlockSchema))
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Release()
	if !reader.Next() || reader.RecordBatch().NumRows() != 3 {
		t.Fatalf("no record batch: %v", reader.Err())
	}
	sameRecords(t, recordsOf(reader.RecordBatch(), h), sampleRecords())
}

func TestSplitBatchesAndOffsets(t *testing.T) {
	a, _ := EncodeColumnBatch(sampleRecords(), BatchFields{BaseSequence: NoSequence})
	b, _ := EncodeRowBatch(sampleRecords()[:1], BatchFields{BaseSequence: NoSequence})
	// As a server stores them: base offsets 10 and 13.
	a[7], b[7] = 10, 13
	messages, err := decodeFrom(TopicPartition{Topic: "t", Partition: 1}, append(bytes.Clone(a), b...), 11, -1)
	if err != nil {
		t.Fatal(err)
	}
	if len(messages) != 3 || messages[0].Offset != 11 || messages[2].Offset != 13 || string(messages[2].Value) != "hello" {
		t.Fatalf("%+v", messages)
	}
	if _, err := decodeFrom(TopicPartition{}, append(bytes.Clone(a), b[:50]...), 0, -1); Reason(err) != ReasonCorruptBatch {
		t.Fatalf("a truncated second batch: %v", err)
	}
}

// A Receive starts one partition further each time: a server takes its messages in
// request order, and the same order every time starved the partitions after a backlog.
func TestReceiveOrderRotates(t *testing.T) {
	s := &Subscription{partitions: []TopicPartition{{"t", 0}, {"t", 1}, {"t", 2}}}
	var firsts []int32
	for i := 0; i < 4; i++ {
		order := s.receiveOrder()
		if len(order) != 3 {
			t.Fatalf("order %v", order)
		}
		firsts = append(firsts, order[0].Partition)
	}
	if fmt.Sprint(firsts) != "[1 2 0 1]" {
		t.Fatalf("first partitions %v, want [1 2 0 1]", firsts)
	}
}
