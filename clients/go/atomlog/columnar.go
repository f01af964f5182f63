package atomlog

// The columnar records block (batch magic 2, docs/record-format.md §1.6): one Arrow IPC
// record batch message of a fixed schema, written and read with Apache Arrow's Go
// library. The block holds no schema: a reader puts the schema message before it and
// reads the two as an IPC stream, as the document says.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

var (
	headerStruct = arrow.StructOf(
		arrow.Field{Name: "key", Type: arrow.BinaryTypes.String, Nullable: false},
		arrow.Field{Name: "value", Type: arrow.BinaryTypes.Binary, Nullable: false})
	// BlockSchema is the schema of every columnar records block.
	BlockSchema = arrow.NewSchema([]arrow.Field{
		{Name: "key", Type: arrow.BinaryTypes.Binary, Nullable: true},
		{Name: "value", Type: arrow.BinaryTypes.Binary, Nullable: true},
		{Name: "timestamp_delta", Type: arrow.PrimitiveTypes.Int64, Nullable: false},
		{Name: "headers", Nullable: false, Type: arrow.ListOfField(
			arrow.Field{Name: "header", Type: headerStruct, Nullable: false})},
	}, nil)
)

const ipcContinuation = 0xFFFFFFFF

var eos = []byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0}

var schemaMessageOnce = sync.OnceValue(func() []byte {
	var buf bytes.Buffer
	w := ipc.NewWriter(&buf, ipc.WithSchema(BlockSchema))
	if err := w.Close(); err != nil { // a stream with no batches: schema message, EOS
		panic(err)
	}
	return bytes.Clone(buf.Bytes()[:buf.Len()-len(eos)])
})

// SchemaMessage is the Arrow IPC stream's schema message of BlockSchema: put it before
// a block (and the end-of-stream marker after) to read the block with any Arrow reader.
func SchemaMessage() []byte { return schemaMessageOnce() }

// columnsBlock encodes records as the columnar block (Arrow's buffer compression for
// zstd and LZ4).
func columnsBlock(records []Record, stamps []int64, base int64, compression Compression) (block []byte, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("arrow encoding failed: %v", p)
		}
	}()
	mem := memory.DefaultAllocator
	b := array.NewRecordBuilder(mem, BlockSchema)
	defer b.Release()
	keys := b.Field(0).(*array.BinaryBuilder)
	values := b.Field(1).(*array.BinaryBuilder)
	deltas := b.Field(2).(*array.Int64Builder)
	headers := b.Field(3).(*array.ListBuilder)
	header := headers.ValueBuilder().(*array.StructBuilder)
	headerKeys := header.FieldBuilder(0).(*array.StringBuilder)
	headerValues := header.FieldBuilder(1).(*array.BinaryBuilder)
	keys.Reserve(len(records))
	values.Reserve(len(records))
	deltas.Reserve(len(records))
	headers.Reserve(len(records))
	for i, r := range records {
		if r.Key == nil {
			keys.AppendNull()
		} else {
			keys.Append(r.Key)
		}
		if r.Value == nil {
			values.AppendNull()
		} else {
			values.Append(r.Value)
		}
		deltas.Append(stamps[i] - base)
		headers.Append(true)
		for _, h := range r.Headers {
			if !utf8.ValidString(h.Key) {
				return nil, errorf(ReasonInvalidArgument, "header key %q is not UTF-8", h.Key)
			}
			header.Append(true)
			headerKeys.Append(h.Key)
			headerValues.Append(nonNil(h.Value))
		}
	}
	rec := b.NewRecordBatch()
	defer rec.Release()
	var options []ipc.Option
	switch compression {
	case CompressionNone:
	case CompressionZstd:
		options = append(options, ipc.WithZstd())
	case CompressionLZ4:
		options = append(options, ipc.WithLZ4())
	default:
		return nil, errorf(ReasonInvalidArgument, "unknown compression %d", compression)
	}
	payload, err := ipc.GetRecordBatchPayload(rec, options...)
	if err != nil {
		return nil, err
	}
	defer payload.Release()
	var buf bytes.Buffer
	if _, err := payload.WritePayload(&buf); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// EncodeColumnBatch encodes records as one magic-2 batch (§1.6): what this client's
// producers send.
func EncodeColumnBatch(records []Record, f BatchFields) ([]byte, error) {
	if len(records) == 0 {
		return nil, errorf(ReasonInvalidArgument, "a batch needs at least one record")
	}
	if err := f.check(); err != nil {
		return nil, err
	}
	stamps, base, maxTs := timestamps(records)
	block, err := columnsBlock(records, stamps, base, f.Compression)
	if err != nil {
		return nil, err
	}
	return frameBatch(block, magicColumns, len(records), base, maxTs, f), nil
}

// decodeColumns reads the block of a magic-2 batch with the checks of §1.6: one record
// batch message of the schema, ending exactly at the end of the batch, that passes
// Arrow's full validation and holds record_count rows.
func decodeColumns(batch []byte, h Header, maxUncompressed int) (records []Record, err error) {
	defer func() {
		if p := recover(); p != nil {
			records, err = nil, corrupt("the columnar block cannot be read: %v", p)
		}
	}()
	block := batch[headerSize:h.Size()]
	if len(block) < 8 {
		return nil, corrupt("the columnar block is shorter than an IPC message prefix")
	}
	metaLength := int64(int32(binary.LittleEndian.Uint32(block[4:])))
	if binary.LittleEndian.Uint32(block) != ipcContinuation || metaLength <= 0 ||
		metaLength%8 != 0 || 8+metaLength > int64(len(block)) {
		return nil, corrupt("the columnar block does not start with an Arrow IPC message")
	}
	message, err := ipc.NewMessageReader(bytes.NewReader(block)).Message()
	if err != nil {
		return nil, corrupt("the columnar block is not an Arrow IPC message: %v", err)
	}
	kind, bodyLength := message.Type(), message.BodyLen()
	message.Release()
	if kind != ipc.MessageRecordBatch {
		return nil, corrupt("the columnar block is an Arrow %s message, not a record batch", kind)
	}
	if left := int64(len(block)) - 8 - metaLength - bodyLength; left != 0 {
		return nil, corrupt("%d bytes after the Arrow message of the columnar block", left)
	}
	stream := make([]byte, 0, len(SchemaMessage())+len(block)+len(eos))
	stream = append(append(append(stream, SchemaMessage()...), block...), eos...)
	reader, err := ipc.NewReader(bytes.NewReader(stream), ipc.WithSchema(BlockSchema))
	if err != nil {
		return nil, corrupt("the columnar block cannot be read: %v", err)
	}
	defer reader.Release()
	if !reader.Next() {
		return nil, corrupt("the columnar block holds no record batch: %v", reader.Err())
	}
	rec := reader.RecordBatch()
	if err := checkColumns(rec, h, maxUncompressed); err != nil {
		return nil, err
	}
	records = recordsOf(rec, h)
	if reader.Next() || reader.Err() != nil {
		return nil, corrupt("the columnar block holds more than one message")
	}
	return records, nil
}

func checkColumns(rec arrow.RecordBatch, h Header, maxUncompressed int) error {
	if !rec.Schema().Equal(BlockSchema) {
		return corrupt("the columnar block's schema is %s", rec.Schema())
	}
	if err := array.ValidateRecordFull(rec); err != nil {
		return corrupt("the columnar block fails Arrow's validation: %v", err)
	}
	if rec.NumRows() != int64(h.RecordCount) {
		return corrupt("the columnar block holds %d rows, the header says %d", rec.NumRows(), h.RecordCount)
	}
	headers := rec.Column(3).(*array.List)
	header := headers.ListValues().(*array.Struct)
	headerKeys := header.Field(0).(*array.String)
	if rec.Column(2).NullN() != 0 || headers.NullN() != 0 || header.NullN() != 0 ||
		headerKeys.NullN() != 0 || header.Field(1).NullN() != 0 {
		return corrupt("the columnar block has nulls in a column that allows none")
	}
	for i := 0; i < headerKeys.Len(); i++ {
		if !utf8.ValidString(headerKeys.Value(i)) {
			return corrupt("header key %d of the columnar block is not UTF-8", i)
		}
	}
	if h.Compression() != CompressionNone {
		size := 0
		for _, column := range rec.Columns() {
			size += dataSize(column.Data())
		}
		if size > maxUncompressed {
			return corrupt("the columnar block holds %d bytes, limit %d", size, maxUncompressed)
		}
	}
	return nil
}

func dataSize(data arrow.ArrayData) int {
	size := 0
	for _, buf := range data.Buffers() {
		if buf != nil {
			size += buf.Len()
		}
	}
	for _, child := range data.Children() {
		size += dataSize(child)
	}
	return size
}

// recordsOf copies the rows of a checked block into Records.
func recordsOf(rec arrow.RecordBatch, h Header) []Record {
	keys := rec.Column(0).(*array.Binary)
	values := rec.Column(1).(*array.Binary)
	deltas := rec.Column(2).(*array.Int64)
	headers := rec.Column(3).(*array.List)
	header := headers.ListValues().(*array.Struct)
	headerKeys := header.Field(0).(*array.String)
	headerValues := header.Field(1).(*array.Binary)
	out := make([]Record, rec.NumRows())
	for i := range out {
		r := &out[i]
		if keys.IsValid(i) {
			r.Key = bytes.Clone(keys.Value(i))
			if r.Key == nil {
				r.Key = []byte{}
			}
		}
		if values.IsValid(i) {
			r.Value = bytes.Clone(values.Value(i))
			if r.Value == nil {
				r.Value = []byte{}
			}
		}
		r.Timestamp = time.UnixMilli(h.BaseTimestampMs + deltas.Value(i))
		start, end := headers.ValueOffsets(i)
		for j := start; j < end; j++ {
			r.Headers = append(r.Headers, RecordHeader{Key: headerKeys.Value(int(j)),
				Value: append([]byte{}, headerValues.Value(int(j))...)})
		}
	}
	return out
}
