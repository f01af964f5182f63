package atomlog

// Record batches: the 77-byte header of docs/record-format.md §1.1 and the row format
// of its records block (magic 1, §1.3). The columnar block (magic 2, §1.6) is in
// columnar.go. All integers of the header are big-endian.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
)

// Header is one record batch header (docs/record-format.md §1.1).
type Header struct {
	BaseOffset      int64
	BatchLength     int32
	Magic           int8
	LogAppendTimeMs int64
	CRC             uint32
	Attributes      int16
	LastOffsetDelta int32
	RecordCount     int32
	BaseTimestampMs int64
	MaxTimestampMs  int64
	ProducerID      int64
	ProducerEpoch   uint16
	BaseSequence    int32
	TxnTCPartition  uint32
	TxnSequence     uint64
}

const (
	headerSize      = 77
	lengthFieldEnd  = 12 // batch_length counts the bytes after byte 12
	crcOffset       = 21
	crcCoveredFrom  = 25
	minBatchLength  = headerSize - lengthFieldEnd
	magicRows       = 1
	magicColumns    = 2
	attrCompression = 0x0007
	attrTxn         = 0x0010
	attrControl     = 0x0020
	attrKnown       = attrCompression | attrTxn | attrControl
	// DefaultMaxUncompressedBytes bounds what one compressed block may expand to.
	DefaultMaxUncompressedBytes = 64 << 20
)

// Compression of a batch's records (attributes bits 0-2).
type Compression int16

const (
	CompressionNone Compression = 0
	CompressionZstd Compression = 1
	CompressionLZ4  Compression = 2
)

// Size is the whole batch's length in bytes.
func (h Header) Size() int { return int(h.BatchLength) + lengthFieldEnd }

// LastOffset is the offset of the batch's last record.
func (h Header) LastOffset() int64 { return h.BaseOffset + int64(h.LastOffsetDelta) }

// Compression is the codec named by the attributes.
func (h Header) Compression() Compression { return Compression(h.Attributes & attrCompression) }

// IsControl: a transaction marker written by a partition server.
func (h Header) IsControl() bool { return h.Attributes&attrControl != 0 }

// IsTransactional: the batch belongs to transaction (TxnTCPartition, TxnSequence).
func (h Header) IsTransactional() bool { return h.Attributes&attrTxn != 0 }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// CRC32C is the Castagnoli CRC of b (the batch CRC, and tc_partition_for's hash).
func CRC32C(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

func corrupt(format string, args ...any) *Error {
	return errorf(ReasonCorruptBatch, format, args...)
}

// ParseHeader reads and checks the header at the start of b (only the header need be
// present), with the rules of §1.1; CORRUPT_BATCH when one fails.
func ParseHeader(b []byte) (Header, error) {
	if len(b) < headerSize {
		return Header{}, corrupt("truncated batch header: %d bytes, a header is %d", len(b), headerSize)
	}
	be := binary.BigEndian
	h := Header{
		BaseOffset:      int64(be.Uint64(b[0:])),
		BatchLength:     int32(be.Uint32(b[8:])),
		Magic:           int8(b[12]),
		LogAppendTimeMs: int64(be.Uint64(b[13:])),
		CRC:             be.Uint32(b[21:]),
		Attributes:      int16(be.Uint16(b[25:])),
		LastOffsetDelta: int32(be.Uint32(b[27:])),
		RecordCount:     int32(be.Uint32(b[31:])),
		BaseTimestampMs: int64(be.Uint64(b[35:])),
		MaxTimestampMs:  int64(be.Uint64(b[43:])),
		ProducerID:      int64(be.Uint64(b[51:])),
		ProducerEpoch:   be.Uint16(b[59:]),
		BaseSequence:    int32(be.Uint32(b[61:])),
		TxnTCPartition:  be.Uint32(b[65:]),
		TxnSequence:     be.Uint64(b[69:]),
	}
	if problem := h.problem(); problem != "" {
		return h, corrupt("%s", problem)
	}
	return h, nil
}

func (h Header) problem() string {
	switch {
	case h.Magic != magicRows && h.Magic != magicColumns:
		return fmt.Sprintf("bad magic %d (expected 1 or 2)", h.Magic)
	case h.BatchLength < minBatchLength:
		return fmt.Sprintf("batch_length %d is below the minimum %d", h.BatchLength, minBatchLength)
	case h.BaseOffset < 0:
		return fmt.Sprintf("negative base_offset %d", h.BaseOffset)
	case h.Attributes&^attrKnown != 0:
		return fmt.Sprintf("unknown attribute bits set in 0x%04x", uint16(h.Attributes))
	case h.Compression() > CompressionLZ4:
		return fmt.Sprintf("unknown compression codec %d", h.Compression())
	case h.RecordCount < 1:
		return fmt.Sprintf("record_count %d (a batch holds at least one record)", h.RecordCount)
	case h.LastOffsetDelta != h.RecordCount-1:
		return fmt.Sprintf("last_offset_delta %d does not match record_count %d", h.LastOffsetDelta, h.RecordCount)
	case h.MaxTimestampMs < h.BaseTimestampMs:
		return fmt.Sprintf("max_timestamp_ms %d is below base_timestamp_ms %d", h.MaxTimestampMs, h.BaseTimestampMs)
	case h.ProducerID < 0:
		return fmt.Sprintf("negative producer_id %d", h.ProducerID)
	case h.BaseSequence < -1:
		return fmt.Sprintf("base_sequence %d (must be -1 or >= 0)", h.BaseSequence)
	case h.ProducerID == 0 && (h.ProducerEpoch != 0 || h.BaseSequence != -1):
		return "producer_epoch and base_sequence must be 0 and -1 without a producer_id"
	case h.ProducerID != 0 && int64(h.BaseSequence)+int64(h.LastOffsetDelta) > math.MaxInt32:
		return fmt.Sprintf("base_sequence %d + record count overflows int32", h.BaseSequence)
	}
	hasTxn := h.TxnTCPartition != 0 || h.TxnSequence != 0
	if h.IsTransactional() != hasTxn {
		return "the transactional bit must be set exactly when a transaction id is present"
	}
	if h.IsControl() {
		if !hasTxn {
			return "a control batch must carry a transaction id"
		}
		if h.RecordCount != 1 || h.Compression() != CompressionNone || h.Magic != magicRows {
			return "a control batch holds exactly one uncompressed record in the row format"
		}
	}
	return ""
}

// VerifyCRC checks the CRC32C of the whole batch b (CRC_MISMATCH).
func VerifyCRC(b []byte, h Header) error {
	if len(b) < h.Size() {
		return corrupt("truncated batch: header declares %d bytes, %d present", h.Size(), len(b))
	}
	if got := CRC32C(b[crcCoveredFrom:h.Size()]); got != h.CRC {
		return newError(ReasonCRCMismatch, fmt.Sprintf(
			"CRC32C mismatch: stored 0x%08x, computed 0x%08x", h.CRC, got),
			map[string]string{"stored_crc": fmt.Sprintf("0x%08x", h.CRC),
				"computed_crc": fmt.Sprintf("0x%08x", got)})
	}
	return nil
}

// BatchFields are what a producer decides in a batch header.
type BatchFields struct {
	ProducerID    int64 // 0: not an idempotent producer
	ProducerEpoch uint16
	BaseSequence  int32 // NoSequence (-1) without a producer id
	Txn           TxnID // zero: not transactional
	Compression   Compression
}

// NoSequence is the base sequence of a batch without a producer id.
const NoSequence = -1

func (f BatchFields) check() error {
	if f.ProducerID < 0 || (f.ProducerID == 0 && (f.ProducerEpoch != 0 || f.BaseSequence != NoSequence)) ||
		(f.ProducerID != 0 && f.BaseSequence < 0) {
		return errorf(ReasonInvalidArgument, "producer id %d, epoch %d, base sequence %d: without a "+
			"producer id the epoch is 0 and the sequence -1, with one the sequence is >= 0",
			f.ProducerID, f.ProducerEpoch, f.BaseSequence)
	}
	if f.Compression < CompressionNone || f.Compression > CompressionLZ4 {
		return errorf(ReasonInvalidArgument, "unknown compression %d", f.Compression)
	}
	return nil
}

// frameBatch puts the header before a records block (of `count` records, magic 1 or 2)
// and computes the CRC: base_offset 0 and log_append_time -1, as producers write them.
func frameBatch(block []byte, magic int8, count int, baseTs, maxTs int64, f BatchFields) []byte {
	out := make([]byte, headerSize+len(block))
	be := binary.BigEndian
	attributes := uint16(f.Compression)
	if !f.Txn.IsZero() {
		attributes |= attrTxn
	}
	be.PutUint64(out[0:], 0)
	be.PutUint32(out[8:], uint32(len(out)-lengthFieldEnd))
	out[12] = byte(magic)
	be.PutUint64(out[13:], math.MaxUint64) // -1
	be.PutUint16(out[25:], attributes)
	be.PutUint32(out[27:], uint32(count-1))
	be.PutUint32(out[31:], uint32(count))
	be.PutUint64(out[35:], uint64(baseTs))
	be.PutUint64(out[43:], uint64(maxTs))
	be.PutUint64(out[51:], uint64(f.ProducerID))
	be.PutUint16(out[59:], f.ProducerEpoch)
	be.PutUint32(out[61:], uint32(f.BaseSequence))
	be.PutUint32(out[65:], f.Txn.TCPartition)
	be.PutUint64(out[69:], f.Txn.Sequence)
	copy(out[headerSize:], block)
	be.PutUint32(out[crcOffset:], CRC32C(out[crcCoveredFrom:]))
	return out
}

// timestamps returns each record's Unix ms (zero Timestamp: now), the first and the max.
func timestamps(records []Record) (stamps []int64, base, max int64) {
	now := time.Now().UnixMilli()
	stamps = make([]int64, len(records))
	for i, r := range records {
		if r.Timestamp.IsZero() {
			stamps[i] = now
		} else {
			stamps[i] = r.Timestamp.UnixMilli()
		}
		if i == 0 || stamps[i] > max {
			max = stamps[i]
		}
	}
	return stamps, stamps[0], max
}

// EncodeRowBatch encodes records in the row format (magic 1, §1.3). atomlog's producers
// write the columnar format; this is for tools, tests and old readers.
func EncodeRowBatch(records []Record, f BatchFields) ([]byte, error) {
	if len(records) == 0 {
		return nil, errorf(ReasonInvalidArgument, "a batch needs at least one record")
	}
	if err := f.check(); err != nil {
		return nil, err
	}
	stamps, base, maxTs := timestamps(records)
	var block []byte
	var scratch []byte
	for i, r := range records {
		scratch = scratch[:0]
		scratch = append(scratch, 0) // attributes
		scratch = appendZvarint(scratch, stamps[i]-base)
		scratch = binary.AppendUvarint(scratch, uint64(i))
		scratch = appendBytesField(scratch, r.Key)
		scratch = appendBytesField(scratch, r.Value)
		scratch = binary.AppendUvarint(scratch, uint64(len(r.Headers)))
		for _, h := range r.Headers {
			scratch = binary.AppendUvarint(scratch, uint64(len(h.Key)))
			scratch = append(scratch, h.Key...)
			scratch = binary.AppendUvarint(scratch, uint64(len(h.Value)))
			scratch = append(scratch, h.Value...)
		}
		block = binary.AppendUvarint(block, uint64(len(scratch)))
		block = append(block, scratch...)
	}
	switch f.Compression {
	case CompressionNone:
	case CompressionZstd:
		encoder, err := zstd.NewWriter(nil)
		if err != nil {
			return nil, err
		}
		block = encoder.EncodeAll(block, nil)
	case CompressionLZ4:
		var out bytes.Buffer
		w := lz4.NewWriter(&out)
		if _, err := w.Write(block); err != nil {
			return nil, err
		}
		if err := w.Close(); err != nil {
			return nil, err
		}
		block = out.Bytes()
	default:
		return nil, errorf(ReasonInvalidArgument, "unknown compression %d", f.Compression)
	}
	return frameBatch(block, magicRows, len(records), base, maxTs, f), nil
}

func appendZvarint(b []byte, n int64) []byte {
	return binary.AppendUvarint(b, uint64(n<<1)^uint64(n>>63))
}

func appendBytesField(b []byte, value []byte) []byte {
	if value == nil {
		return appendZvarint(b, -1)
	}
	b = appendZvarint(b, int64(len(value)))
	return append(b, value...)
}

// decodeRows reads the records block of a magic-1 batch.
func decodeRows(batch []byte, h Header, maxUncompressed int) ([]Record, error) {
	block := batch[headerSize:h.Size()]
	switch h.Compression() {
	case CompressionNone:
	case CompressionZstd:
		decoder, err := zstd.NewReader(nil, zstd.WithDecoderMaxMemory(uint64(maxUncompressed)),
			zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, err
		}
		defer decoder.Close()
		out, err := decoder.DecodeAll(block, nil)
		if err != nil {
			return nil, corrupt("zstd block does not decompress: %v", err)
		}
		if len(out) > maxUncompressed {
			return nil, corrupt("records block holds more than %d bytes", maxUncompressed)
		}
		block = out
	case CompressionLZ4:
		r := lz4.NewReader(bytes.NewReader(block))
		out, err := io.ReadAll(io.LimitReader(r, int64(maxUncompressed)+1))
		if err != nil {
			return nil, corrupt("lz4 block does not decompress: %v", err)
		}
		if len(out) > maxUncompressed {
			return nil, corrupt("records block holds more than %d bytes", maxUncompressed)
		}
		block = out
	}
	records := make([]Record, 0, h.RecordCount)
	pos := 0
	for i := 0; i < int(h.RecordCount); i++ {
		length, n := binary.Uvarint(block[pos:])
		if n <= 0 || length > uint64(len(block)-pos-n) {
			return nil, corrupt("record %d: bad length", i)
		}
		pos += n
		end := pos + int(length)
		r := rowReader{b: block[:end], pos: pos}
		record, err := r.record(h, i)
		if err != nil {
			return nil, err
		}
		if r.pos != end {
			return nil, corrupt("record %d: %d bytes left over inside it", i, end-r.pos)
		}
		records = append(records, record)
		pos = end
	}
	if pos != len(block) {
		return nil, corrupt("%d bytes after the last record", len(block)-pos)
	}
	return records, nil
}

type rowReader struct {
	b   []byte
	pos int
	bad bool
}

func (r *rowReader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b[r.pos:])
	if n <= 0 {
		r.bad = true
		return 0
	}
	r.pos += n
	return v
}

func (r *rowReader) zvarint() int64 {
	u := r.uvarint()
	return int64(u>>1) ^ -int64(u&1)
}

func (r *rowReader) take(n int) []byte {
	if n < 0 || n > len(r.b)-r.pos {
		r.bad = true
		return nil
	}
	out := r.b[r.pos : r.pos+n : r.pos+n]
	r.pos += n
	return out
}

func (r *rowReader) nullable() []byte {
	n := r.zvarint()
	if n == -1 {
		return nil
	}
	if n < -1 || n > int64(len(r.b)) {
		r.bad = true
		return nil
	}
	out := r.take(int(n))
	if out == nil && !r.bad {
		out = []byte{}
	}
	return out
}

func (r *rowReader) record(h Header, index int) (Record, error) {
	if len(r.b)-r.pos < 1 || r.b[r.pos] != 0 {
		return Record{}, corrupt("record %d: attributes must be 0", index)
	}
	r.pos++
	delta := r.zvarint()
	offsetDelta := r.uvarint()
	key := r.nullable()
	value := r.nullable()
	count := r.uvarint()
	if r.bad || count > uint64(len(r.b)) {
		return Record{}, corrupt("record %d is malformed", index)
	}
	var headers []RecordHeader
	for j := uint64(0); j < count; j++ {
		k := r.take(int(r.uvarint()))
		v := r.take(int(r.uvarint()))
		if r.bad {
			return Record{}, corrupt("record %d: header %d is malformed", index, j)
		}
		headers = append(headers, RecordHeader{Key: string(k), Value: v})
	}
	if r.bad {
		return Record{}, corrupt("record %d is malformed", index)
	}
	if offsetDelta != uint64(index) {
		return Record{}, corrupt("record %d has offset_delta %d", index, offsetDelta)
	}
	return Record{Key: key, Value: value, Headers: headers,
		Timestamp: time.UnixMilli(h.BaseTimestampMs + delta)}, nil
}

// DecodeBatch checks one whole batch (header rules, CRC32C) and returns its records
// (magic 1 or 2). Offsets are BaseOffset + index.
func DecodeBatch(batch []byte) (Header, []Record, error) {
	h, err := ParseHeader(batch)
	if err != nil {
		return h, nil, err
	}
	if err := VerifyCRC(batch, h); err != nil {
		return h, nil, err
	}
	var records []Record
	if h.Magic == magicRows {
		records, err = decodeRows(batch, h, DefaultMaxUncompressedBytes)
	} else {
		records, err = decodeColumns(batch, h, DefaultMaxUncompressedBytes)
	}
	return h, records, err
}

// SplitBatches walks concatenated batches (a Fetch or Receive result) and calls fn with
// each whole batch; CORRUPT_BATCH when one does not fit.
func SplitBatches(data []byte, fn func(batch []byte, h Header) error) error {
	for pos := 0; pos < len(data); {
		h, err := ParseHeader(data[pos:])
		if err != nil {
			return err
		}
		if h.Size() > len(data)-pos {
			return corrupt("batch at byte %d declares %d bytes, %d present", pos, h.Size(), len(data)-pos)
		}
		if err := fn(data[pos:pos+h.Size()], h); err != nil {
			return err
		}
		pos += h.Size()
	}
	return nil
}
