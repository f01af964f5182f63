//! atomlog's native core: the record batch's header work on the servers' hot path (parse
//! and check a header, check a whole batch and its CRC32C, stamp a one-call transaction's
//! batch, frame a batch around its records block), a log's append planned in one call
//! (checked, stamped, accounted for; log_append.rs: with its write-ahead frame's head),
//! and the SDK's records block of a small batch.
//!
//! Each function here is the function of the same name in partition_server/record_batch.py
//! (plain_block: record_columns.py), which stays the reference: the same answers, the same
//! errors (AtomlogError with the same reason, message and metadata; ValueError for a
//! caller's mistake). tests/test_native.py holds the two together on generated and damaged
//! batches. partition_server/native.py loads this module and record_batch.py and
//! record_columns.py put these functions in place of their own.
//!
//! Also the cells of services/fastmetrics.py's counters and histograms.
//!
//! Pure: no I/O, no clock, no state but the two Python types `init` is given and the
//! metric cells' values.

use pyo3::ffi;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyTuple, PyType};
use std::sync::atomic::{AtomicU64, Ordering};

mod crc32c;
mod log_append;
mod producer_state;
mod records;
mod txn_buffer;
mod txn_guard;
mod write_step;

// The layout (record_batch.py's constants; its module doc has the table).
const HEADER_SIZE: usize = 77;
const PREFIX_SIZE: usize = 21;
const CRC_OFFSET: usize = PREFIX_SIZE;
const CRC_COVERED_FROM: usize = CRC_OFFSET + 4;
const LENGTH_FIELD_END: i64 = 12;
const MIN_BATCH_LENGTH: i64 = HEADER_SIZE as i64 - LENGTH_FIELD_END;
const MAGIC: i8 = 1;
const MAGIC_COLUMNAR: i8 = 2;
const ATTR_COMPRESSION_MASK: i16 = 0x0007;
const ATTR_TRANSACTIONAL: i16 = 0x0010;
const ATTR_CONTROL: i16 = 0x0020;
const ATTR_KNOWN_BITS: i16 = ATTR_COMPRESSION_MASK | ATTR_TRANSACTIONAL | ATTR_CONTROL;
const MAX_CODEC: i16 = 2; // Compression.LZ4
const NO_PRODUCER_ID: i64 = 0;
const NO_SEQUENCE: i32 = -1;
const NO_TIMESTAMP: i64 = -1;
const PRODUCER_EPOCH_MAX: i64 = 0xFFFF;
const INT32_MAX: i64 = i32::MAX as i64;
const DEFAULT_MAX_BATCH_BYTES: i64 = 1 << 20;

/// The Python types the answers are made of, given once by `init`.
struct Types {
    header: Py<PyType>,
    error: Py<PyAny>,
    tuple_new: Py<PyAny>,
}

static TYPES: GILOnceCell<Types> = GILOnceCell::new();

fn types(py: Python<'_>) -> PyResult<&Types> {
    TYPES.get(py).ok_or_else(|| {
        PyRuntimeError::new_err("partition_server._native: init(BatchHeader, AtomlogError) first")
    })
}

/// Called once by record_batch.py: its BatchHeader (the answers' type) and AtomlogError.
#[pyfunction]
fn init(py: Python<'_>, header: Bound<'_, PyType>, error: Bound<'_, PyAny>) -> PyResult<()> {
    let tuple_new = py.get_type::<PyTuple>().getattr("__new__")?.unbind();
    let _ = TYPES.set(py, Types { header: header.unbind(), error: error.unbind(), tuple_new });
    Ok(())
}

/// The header's fields in their order (BatchHeader's), each with its type and its byte
/// offset in the batch (`name: type = offset`): the one list from which the struct, its
/// reading and writing and its conversions to and from Python's BatchHeader are made.
macro_rules! header_layout {
    ($($field:ident: $type:ty = $at:expr),* $(,)?) => {
        #[derive(Clone, Copy, Debug, PartialEq)]
        struct Header {
            $($field: $type),*
        }

        impl Header {
            /// The header at the start of `b` (at least HEADER_SIZE bytes), unchecked.
            fn read(b: &[u8]) -> Header {
                Header { $($field: <$type>::from_be_bytes(be(b, $at))),* }
            }

            fn write(&self, out: &mut [u8]) {
                $(out[$at..$at + std::mem::size_of::<$type>()]
                    .copy_from_slice(&self.$field.to_be_bytes());)*
            }

            /// The BatchHeader of these fields.
            fn to_python(&self, py: Python<'_>) -> PyResult<PyObject> {
                let types = types(py)?;
                let fields = PyTuple::new(py, [$(self.$field.into_pyobject(py)?.into_any()),*])?;
                // tuple.__new__(BatchHeader, fields): what BatchHeader._make does, without
                // its Python frame.
                Ok(types.tuple_new.call1(py, (types.header.clone_ref(py), fields))?)
            }

            /// A BatchHeader (or any 15-tuple of ints in its order) given by Python.
            fn from_python(header: &Bound<'_, PyAny>) -> PyResult<Header> {
                let fields = header.downcast::<PyTuple>()?;
                if fields.len() != HEADER_FIELDS {
                    return Err(PyValueError::new_err("a BatchHeader has 15 fields"));
                }
                let mut items = fields.iter();
                Ok(Header { $($field: items.next().expect("15 fields").extract()?),* })
            }
        }
    };
}

header_layout! {
    base_offset: i64 = 0,
    batch_length: i32 = 8,
    magic: i8 = 12,
    log_append_time_ms: i64 = 13,
    crc: u32 = 21,
    attributes: i16 = 25,
    last_offset_delta: i32 = 27,
    record_count: i32 = 31,
    base_timestamp_ms: i64 = 35,
    max_timestamp_ms: i64 = 43,
    producer_id: i64 = 51,
    producer_epoch: u16 = 59,
    base_sequence: i32 = 61,
    txn_tc_partition: u32 = 65,
    txn_sequence: u64 = 69,
}

const HEADER_FIELDS: usize = 15;

fn be<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

impl Header {
    /// Bytes of the whole batch (BatchHeader.size).
    fn size(&self) -> i64 {
        self.batch_length as i64 + LENGTH_FIELD_END
    }

    /// record_batch._header_problem: the cross-field rules, None when consistent.
    fn problem(&self) -> Option<String> {
        let h = self;
        if h.base_offset < 0 {
            return Some(format!("negative base_offset {}", h.base_offset));
        }
        if h.attributes & !ATTR_KNOWN_BITS != 0 {
            return Some(format!("unknown attribute bits set in 0x{:04x}", h.attributes as u16));
        }
        if h.attributes & ATTR_COMPRESSION_MASK > MAX_CODEC {
            return Some(format!("unknown compression codec {}", h.attributes & ATTR_COMPRESSION_MASK));
        }
        if h.record_count < 1 {
            return Some(format!(
                "record_count {} (a batch holds at least one record)",
                h.record_count
            ));
        }
        if h.last_offset_delta as i64 != h.record_count as i64 - 1 {
            return Some(format!(
                "last_offset_delta {} does not match record_count {}",
                h.last_offset_delta, h.record_count
            ));
        }
        if h.max_timestamp_ms < h.base_timestamp_ms {
            return Some(format!(
                "max_timestamp_ms {} is below base_timestamp_ms {}",
                h.max_timestamp_ms, h.base_timestamp_ms
            ));
        }
        if h.producer_id < 0 {
            return Some(format!("negative producer_id {}", h.producer_id));
        }
        if h.base_sequence < NO_SEQUENCE {
            return Some(format!("base_sequence {} (must be -1 or >= 0)", h.base_sequence));
        }
        if h.producer_id == NO_PRODUCER_ID && (h.producer_epoch != 0 || h.base_sequence != NO_SEQUENCE)
        {
            return Some(
                "producer_epoch and base_sequence must be 0 and -1 without a producer_id".into(),
            );
        }
        if h.producer_id != NO_PRODUCER_ID
            && h.base_sequence as i64 + h.last_offset_delta as i64 > INT32_MAX
        {
            return Some(format!(
                "base_sequence {} + record count overflows int32",
                h.base_sequence
            ));
        }
        let has_txn = h.txn_tc_partition != 0 || h.txn_sequence != 0;
        if (h.attributes & ATTR_TRANSACTIONAL != 0) != has_txn {
            return Some(
                "the transactional bit must be set exactly when a transaction id is present".into(),
            );
        }
        if h.attributes & ATTR_CONTROL != 0 {
            if !has_txn {
                return Some("a control batch must carry a transaction id".into());
            }
            if h.record_count != 1 || h.attributes & ATTR_COMPRESSION_MASK != 0 || h.magic != MAGIC {
                return Some(
                    "a control batch holds exactly one uncompressed record in the row format"
                        .into(),
                );
            }
        }
        None
    }
}

// --- Errors, as record_batch.py raises them ------------------------------------------------

fn atomlog_error(py: Python<'_>, reason: &str, message: String, metadata: &[(&str, String)]) -> PyErr {
    match types(py) {
        Ok(types) => new_atomlog_error(py, &types.error, reason, message, metadata),
        Err(error) => error,
    }
}

/// An AtomlogError of `class` (services.errors.AtomlogError, as the caller's module looked
/// it up) with `reason`, `message` and `metadata`, to raise; a failure to make it is
/// raised instead.
pub(crate) fn new_atomlog_error(py: Python<'_>, class: &Py<PyAny>, reason: &str, message: String,
                                metadata: &[(&str, String)]) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let details = PyDict::new(py);
        for (key, value) in metadata {
            details.set_item(*key, value)?;
        }
        let error = class.call1(py, (reason, message, details))?;
        Ok(PyErr::from_value(error.into_bound(py)))
    };
    build().unwrap_or_else(|error| error)
}

/// record_batch._corrupt.
fn corrupt(py: Python<'_>, message: String, position: Option<i64>) -> PyErr {
    match position {
        Some(position) => atomlog_error(py, "CORRUPT_BATCH", message, &[("position", position.to_string())]),
        None => atomlog_error(py, "CORRUPT_BATCH", message, &[]),
    }
}

fn struct_error(py: Python<'_>, message: &str) -> PyErr {
    match py.import("struct").and_then(|module| module.getattr("error")) {
        Ok(class) => match class.call1((message,)) {
            Ok(error) => PyErr::from_value(error),
            Err(error) => error,
        },
        Err(error) => error,
    }
}

// --- Bytes from Python ----------------------------------------------------------------------

/// `f` with the bytes of `object`: bytes directly, else through the buffer protocol as a
/// simple (C-contiguous, format-free) buffer, as `crc32c` and `bytes` read any: bytearray,
/// memoryview, Arrow's buffers. Nothing runs Python code meanwhile.
fn with_bytes<R>(object: &Bound<'_, PyAny>, f: impl FnOnce(&[u8]) -> PyResult<R>) -> PyResult<R> {
    if let Ok(bytes) = object.downcast::<PyBytes>() {
        return f(bytes.as_bytes());
    }
    let view = SimpleBuffer::get(object)?;
    f(view.bytes())
}

/// A Py_buffer held (so a bytearray cannot resize) until dropped.
struct SimpleBuffer(Box<ffi::Py_buffer>);

impl SimpleBuffer {
    fn get(object: &Bound<'_, PyAny>) -> PyResult<SimpleBuffer> {
        // SAFETY: a zeroed Py_buffer is what PyObject_GetBuffer fills; on failure it
        // holds nothing to release.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        if unsafe { ffi::PyObject_GetBuffer(object.as_ptr(), &mut *view, ffi::PyBUF_SIMPLE) } != 0 {
            return Err(PyErr::fetch(object.py()));
        }
        Ok(SimpleBuffer(view))
    }

    fn bytes(&self) -> &[u8] {
        if self.0.buf.is_null() || self.0.len <= 0 {
            return &[];
        }
        // SAFETY: a simple buffer is `len` contiguous bytes at `buf`, valid while held.
        unsafe { std::slice::from_raw_parts(self.0.buf as *const u8, self.0.len as usize) }
    }
}

impl Drop for SimpleBuffer {
    fn drop(&mut self) {
        // SAFETY: filled by a successful PyObject_GetBuffer, released once; the GIL is
        // held (every caller holds it for the buffer's life).
        unsafe { ffi::PyBuffer_Release(&mut *self.0) }
    }
}

// --- The functions ----------------------------------------------------------------------------

fn parse(py: Python<'_>, buf: &[u8], offset: i64, max_batch_bytes: Option<i64>) -> PyResult<Header> {
    if offset < 0 {
        return Err(PyValueError::new_err(format!("offset {} (must be >= 0)", offset)));
    }
    let present = buf.len() as i64 - offset;
    if present < HEADER_SIZE as i64 {
        return Err(corrupt(
            py,
            format!("truncated batch header: {} bytes, a header is {}", present.max(0), HEADER_SIZE),
            Some(offset),
        ));
    }
    let header = Header::read(&buf[offset as usize..]);
    if header.magic != MAGIC && header.magic != MAGIC_COLUMNAR {
        return Err(corrupt(
            py,
            format!("bad magic {} (expected one of ({}, {}))", header.magic, MAGIC, MAGIC_COLUMNAR),
            Some(offset),
        ));
    }
    if (header.batch_length as i64) < MIN_BATCH_LENGTH {
        return Err(corrupt(
            py,
            format!(
                "batch_length {} is below the minimum {}",
                header.batch_length, MIN_BATCH_LENGTH
            ),
            Some(offset),
        ));
    }
    if let Some(limit) = max_batch_bytes {
        if header.size() > limit {
            return Err(atomlog_error(
                py,
                "BATCH_TOO_LARGE",
                format!("batch of {} bytes exceeds the limit of {} bytes", header.size(), limit),
                &[("limit", limit.to_string()), ("position", offset.to_string())],
            ));
        }
    }
    if let Some(problem) = header.problem() {
        return Err(corrupt(py, problem, Some(offset)));
    }
    Ok(header)
}

fn check_crc(py: Python<'_>, batch: &[u8], size: i64, stored: u32, position: i64) -> PyResult<()> {
    // (i128: a position and size near i64's end are a truncated batch, as in Python.)
    let end = position as i128 + size as i128;
    if (batch.len() as i128) < end {
        return Err(corrupt(
            py,
            format!(
                "truncated batch: header declares {} bytes, {} present",
                size,
                batch.len() as i128 - position as i128
            ),
            Some(position),
        ));
    }
    let end = end.max(0) as usize; // <= batch.len()
    let from = (position as i128 + CRC_COVERED_FROM as i128).clamp(0, end as i128) as usize;
    let computed = crc32c::value(&batch[from..end], 0);
    if computed != stored {
        return Err(atomlog_error(
            py,
            "CRC_MISMATCH",
            format!("CRC32C mismatch: stored 0x{:08x}, computed 0x{:08x}", stored, computed),
            &[
                ("position", position.to_string()),
                ("stored_crc", format!("0x{:08x}", stored)),
                ("computed_crc", format!("0x{:08x}", computed)),
            ],
        ));
    }
    Ok(())
}

/// record_batch.parse_header.
#[pyfunction]
#[pyo3(signature = (buf, offset = 0, *, max_batch_bytes = None))]
fn parse_header(
    py: Python<'_>,
    buf: &Bound<'_, PyAny>,
    offset: i64,
    max_batch_bytes: Option<i64>,
) -> PyResult<PyObject> {
    with_bytes(buf, |bytes| parse(py, bytes, offset, max_batch_bytes))?.to_python(py)
}

/// record_batch.verify_crc.
#[pyfunction]
#[pyo3(signature = (batch, header = None, position = 0))]
fn verify_crc(
    py: Python<'_>,
    batch: &Bound<'_, PyAny>,
    header: Option<&Bound<'_, PyAny>>,
    position: i64,
) -> PyResult<()> {
    // Of a given header, only what Python's verify_crc reads: its size and CRC.
    let given: Option<(i64, u32)> = match header {
        Some(header) if !header.is_none() => Some((
            header.getattr(pyo3::intern!(py, "batch_length"))?.extract::<i64>()? + LENGTH_FIELD_END,
            header.getattr(pyo3::intern!(py, "crc"))?.extract()?,
        )),
        _ => None,
    };
    with_bytes(batch, |bytes| {
        let (size, crc) = match given {
            Some(given) => given,
            None => {
                let header = parse(py, bytes, position, None)?;
                (header.size(), header.crc)
            }
        };
        check_crc(py, bytes, size, crc, position)
    })
}

/// record_batch.validate_batch.
#[pyfunction]
#[pyo3(signature = (batch, *, max_batch_bytes = DEFAULT_MAX_BATCH_BYTES))]
fn validate_batch(py: Python<'_>, batch: &Bound<'_, PyAny>, max_batch_bytes: i64) -> PyResult<PyObject> {
    let header = with_bytes(batch, |bytes| {
        let length = bytes.len() as i64;
        if length > max_batch_bytes {
            return Err(atomlog_error(
                py,
                "BATCH_TOO_LARGE",
                format!("batch of {} bytes exceeds the limit of {} bytes", length, max_batch_bytes),
                &[("limit", max_batch_bytes.to_string())],
            ));
        }
        let header = parse(py, bytes, 0, None)?;
        if header.size() != length {
            let why = if header.size() > length { " (truncated)" } else { " (trailing bytes)" };
            return Err(corrupt(
                py,
                format!("batch_length says {} bytes, but the batch has {}{}", header.size(), length, why),
                None,
            ));
        }
        check_crc(py, bytes, header.size(), header.crc, 0)?;
        Ok(header)
    })?;
    header.to_python(py)
}

/// record_batch.check_stageable's refusals, None when the batch may be staged.
fn stage_refusal(header: &Header) -> Option<&'static str> {
    if header.attributes & (ATTR_TRANSACTIONAL | ATTR_CONTROL) != 0 {
        return Some(
            "a one-call transaction's batch must not be transactional or a control batch: the \
             coordinator assigns it its transaction",
        );
    }
    if header.producer_id != NO_PRODUCER_ID {
        return Some(
            "a one-call transaction's batch has no producer id (0) and no sequence (-1): it is \
             deduplicated by its transaction",
        );
    }
    None
}

/// record_batch.stamp_transaction: the batch made part of `txn` (its bit, its id, the
/// CRC32C again), with its header.
#[pyfunction]
fn stamp_transaction(
    py: Python<'_>,
    batch: &Bound<'_, PyAny>,
    header: &Bound<'_, PyAny>,
    txn: &Bound<'_, PyAny>,
) -> PyResult<(PyObject, PyObject)> {
    let header = Header::from_python(header)?;
    if let Some(refusal) = stage_refusal(&header) {
        return Err(atomlog_error(py, "INVALID_ARGUMENT", refusal.into(), &[]));
    }
    let (tc_partition, sequence): (i128, i128) = (txn.get_item(0)?.extract()?, txn.get_item(1)?.extract()?);
    if !(0..=u32::MAX as i128).contains(&tc_partition) || !(0..=u64::MAX as i128).contains(&sequence) {
        return Err(struct_error(py, "argument out of range"));
    }
    let attributes = header.attributes | ATTR_TRANSACTIONAL;
    let (out, crc) = with_bytes(batch, |bytes| {
        if bytes.len() < HEADER_SIZE {
            return Err(struct_error(py, "buffer too small for a batch header"));
        }
        let crc = {
            // The checksum of the new bytes without building them twice: the stamped
            // fields, then the rest as it is.
            let mut head = [0u8; HEADER_SIZE - CRC_COVERED_FROM];
            head.copy_from_slice(&bytes[CRC_COVERED_FROM..HEADER_SIZE]);
            head[0..2].copy_from_slice(&attributes.to_be_bytes());
            head[40..44].copy_from_slice(&(tc_partition as u32).to_be_bytes());
            head[44..52].copy_from_slice(&(sequence as u64).to_be_bytes());
            crc32c::value(&bytes[HEADER_SIZE..], crc32c::value(&head, 0))
        };
        let out = PyBytes::new_with(py, bytes.len(), |out| {
            out.copy_from_slice(bytes);
            out[25..27].copy_from_slice(&attributes.to_be_bytes());
            out[65..69].copy_from_slice(&(tc_partition as u32).to_be_bytes());
            out[69..77].copy_from_slice(&(sequence as u64).to_be_bytes());
            out[CRC_OFFSET..CRC_OFFSET + 4].copy_from_slice(&crc.to_be_bytes());
            Ok(())
        })?;
        Ok((out, crc))
    })?;
    let stamped = Header {
        attributes,
        crc,
        txn_tc_partition: tc_partition as u32,
        txn_sequence: sequence as u64,
        ..header
    };
    if let Some(problem) = stamped.problem() {
        return Err(corrupt(py, problem, Some(0)));
    }
    Ok((out.into_any().unbind(), stamped.to_python(py)?))
}

/// record_batch.frame_batch_parsed: a batch around a records block already built, with
/// its header.
#[pyfunction]
#[pyo3(signature = (body, *, magic, count, base_timestamp_ms, max_timestamp_ms, compression = None,
                    producer_id = NO_PRODUCER_ID, producer_epoch = 0, base_sequence = NO_SEQUENCE as i64,
                    txn = None, transactional = None, control = None))]
#[allow(clippy::too_many_arguments)]
fn frame_batch_parsed(
    py: Python<'_>,
    body: &Bound<'_, PyAny>,
    magic: i64,
    count: i64,
    base_timestamp_ms: i64,
    max_timestamp_ms: i64,
    compression: Option<&Bound<'_, PyAny>>,
    producer_id: i64,
    producer_epoch: i64,
    base_sequence: i64,
    txn: Option<&Bound<'_, PyAny>>,
    transactional: Option<&Bound<'_, PyAny>>,
    control: Option<&Bound<'_, PyAny>>,
) -> PyResult<(PyObject, PyObject)> {
    let txn = txn.filter(|txn| !txn.is_none());
    // As Python reads `transactional`: None is whether a txn is given, else it must equal
    // that (so it then is that); `control` by its truth.
    let transactional = match transactional.filter(|flag| !flag.is_none()) {
        Some(flag) if !flag.eq(txn.is_some())? => !txn.is_some(),
        _ => txn.is_some(),
    };
    let control = match control {
        Some(flag) => flag.is_truthy()?,
        None => false,
    };
    let (tc_partition, sequence): (i128, i128) = match txn {
        Some(txn) => {
            let pair = txn.try_iter()?.collect::<PyResult<Vec<_>>>()?;
            if pair.len() != 2 {
                return Err(PyValueError::new_err("a transaction id is (tc_partition, sequence)"));
            }
            (pair[0].extract()?, pair[1].extract()?)
        }
        None => (0, 0),
    };
    if transactional != txn.is_some() || (txn.is_some() && tc_partition == 0 && sequence == 0) {
        return Err(PyValueError::new_err(
            "transactional batches need a non-zero txn id, and only they may carry one",
        ));
    }
    if producer_id == NO_PRODUCER_ID && (producer_epoch != 0 || base_sequence != NO_SEQUENCE as i64) {
        return Err(PyValueError::new_err("producer_epoch/base_sequence need a producer_id"));
    }
    if !(0..=PRODUCER_EPOCH_MAX).contains(&producer_epoch) {
        return Err(PyValueError::new_err(format!(
            "producer_epoch {} outside 0..{}",
            producer_epoch, PRODUCER_EPOCH_MAX
        )));
    }
    let codec: i64 = match compression {
        None => 0,
        Some(compression) => match compression.extract::<i64>() {
            Ok(codec) if (0..=MAX_CODEC as i64).contains(&codec) => codec,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{} is not a valid Compression",
                    compression.repr()?
                )))
            }
        },
    };
    let attributes = codec as i16
        | if transactional { ATTR_TRANSACTIONAL } else { 0 }
        | if control { ATTR_CONTROL } else { 0 };
    with_bytes(body, |body| {
        let batch_length = MIN_BATCH_LENGTH + body.len() as i64;
        let fits = i8::try_from(magic).is_ok()
            && i32::try_from(count - 1).is_ok()
            && i32::try_from(count).is_ok()
            && i32::try_from(batch_length).is_ok()
            && i32::try_from(base_sequence).is_ok()
            && (0..=u32::MAX as i128).contains(&tc_partition)
            && (0..=u64::MAX as i128).contains(&sequence);
        if !fits {
            return Err(struct_error(py, "argument out of range"));
        }
        let mut header = Header {
            base_offset: 0,
            batch_length: batch_length as i32,
            magic: magic as i8,
            log_append_time_ms: NO_TIMESTAMP,
            crc: 0,
            attributes,
            last_offset_delta: (count - 1) as i32,
            record_count: count as i32,
            base_timestamp_ms,
            max_timestamp_ms,
            producer_id,
            producer_epoch: producer_epoch as u16,
            base_sequence: base_sequence as i32,
            txn_tc_partition: tc_partition as u32,
            txn_sequence: sequence as u64,
        };
        let mut head = [0u8; HEADER_SIZE];
        header.write(&mut head);
        header.crc = crc32c::value(body, crc32c::value(&head[CRC_COVERED_FROM..], 0));
        head[CRC_OFFSET..CRC_OFFSET + 4].copy_from_slice(&header.crc.to_be_bytes());
        let batch = PyBytes::new_with(py, HEADER_SIZE + body.len(), |out| {
            out[..HEADER_SIZE].copy_from_slice(&head);
            out[HEADER_SIZE..].copy_from_slice(body);
            Ok(())
        })?;
        // A pair assertion too, as in Python: what we build, we accept.
        let parsed = parse(py, batch.as_bytes(), 0, None)?;
        debug_assert_eq!(parsed, header);
        Ok((batch.into_any().unbind(), parsed.to_python(py)?))
    })
}

/// A batch given with its header, its bytes held, and the header fields a log's write reads.
struct LogItem<'py> {
    header: Bound<'py, PyTuple>,
    view: BatchBytes<'py>,
    batch_length: i32,
    magic: i8,
    attributes: i16,
    last_offset_delta: i32,
    max_timestamp_ms: i64,
}

/// The (batch, header) pairs of a log's write, in order.
fn log_items<'py>(group: &Bound<'py, PyAny>) -> PyResult<Vec<LogItem<'py>>> {
    let mut items = Vec::new();
    for item in group.try_iter()? {
        let item = item?;
        let (batch, header): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract()?;
        let header = header.downcast_into::<PyTuple>()?;
        if header.len() != HEADER_FIELDS {
            return Err(PyValueError::new_err("a BatchHeader has 15 fields"));
        }
        items.push(LogItem {
            view: BatchBytes::of(&batch)?,
            batch_length: header.get_item(1)?.extract()?,
            magic: header.get_item(2)?.extract()?,
            attributes: header.get_item(5)?.extract()?,
            last_offset_delta: header.get_item(6)?.extract()?,
            max_timestamp_ms: header.get_item(9)?.extract()?,
            header,
        });
    }
    Ok(items)
}

/// stamp_for_log's work on items: the one buffer, each stamped header, the offset after.
fn stamp_items(py: Python<'_>, items: &[LogItem<'_>], next_offset: i64, now: i64)
               -> PyResult<(PyObject, Vec<PyObject>, i64)> {
    let types = types(py)?;
    let total: usize = items
        .iter()
        .map(|item| item.view.bytes().len().saturating_sub(PREFIX_SIZE) + PREFIX_SIZE)
        .sum();
    let mut stamped = Vec::with_capacity(items.len());
    let mut prefixes = Vec::with_capacity(items.len());
    let mut offset = next_offset;
    let offset_object = |value: i64| value.into_pyobject(py).map(|v| v.into_any());
    let now_object = offset_object(now)?;
    for item in items {
        let mut prefix = [0u8; PREFIX_SIZE];
        prefix[0..8].copy_from_slice(&offset.to_be_bytes());
        prefix[8..12].copy_from_slice(&item.batch_length.to_be_bytes());
        prefix[12] = item.magic as u8;
        prefix[13..21].copy_from_slice(&now.to_be_bytes());
        prefixes.push(prefix);
        // The header's own field objects but the two stamped ones.
        let mut fields = Vec::with_capacity(HEADER_FIELDS);
        for (index, field) in item.header.iter().enumerate() {
            fields.push(match index {
                0 => offset_object(offset)?,
                3 => now_object.clone(),
                _ => field,
            });
        }
        let fields = PyTuple::new(py, fields)?;
        stamped.push(types.tuple_new.call1(py, (types.header.clone_ref(py), fields))?);
        offset = offset
            .checked_add(item.last_offset_delta as i64 + 1)
            .ok_or_else(|| struct_error(py, "argument out of range"))?;
    }
    let data = PyBytes::new_with(py, total, |out| {
        let mut at = 0;
        for (prefix, item) in prefixes.iter().zip(items) {
            let rest = item.view.bytes().get(PREFIX_SIZE..).unwrap_or(&[]);
            out[at..at + PREFIX_SIZE].copy_from_slice(prefix);
            out[at + PREFIX_SIZE..at + PREFIX_SIZE + rest.len()].copy_from_slice(rest);
            at += PREFIX_SIZE + rest.len();
        }
        Ok(())
    })?;
    let buffers = if items.is_empty() {
        pyo3::types::PyList::empty(py)
    } else {
        pyo3::types::PyList::new(py, [data])?
    };
    Ok((buffers.into_any().unbind(), stamped, offset))
}

/// record_batch.stamp_for_log: a log's write of whole batches from `next_offset` on at
/// append time `now`, as one buffer (the batches with their base offsets and append time
/// stamped: fields before the CRC), each batch's header as stamped, and the offset after.
#[pyfunction]
fn stamp_for_log(
    py: Python<'_>,
    group: &Bound<'_, PyAny>,
    next_offset: i64,
    now: i64,
) -> PyResult<(PyObject, PyObject, i64)> {
    let items = log_items(group)?;
    let (buffers, stamped, offset) = stamp_items(py, &items, next_offset, now)?;
    let stamped = pyo3::types::PyList::new(py, stamped)?;
    Ok((buffers, stamped.into_any().unbind(), offset))
}

/// record_batch.SEGMENT_OFFSETS_MAX (segment.RELATIVE_OFFSET_MAX).
const SEGMENT_OFFSETS_MAX: i64 = 0xFFFF_FFFF;

/// plan_log_append's checks of `items`, each batch in order (CORRUPT_BATCH, BATCH_TOO_LARGE),
/// then whether they all go to the active segment (false: a batch would roll it).
#[allow(clippy::too_many_arguments)]
fn check_log_append(
    py: Python<'_>,
    items: &[LogItem<'_>],
    next_offset: i64,
    now: i64,
    max_batch_bytes: i64,
    size: i64,
    first_time: Option<i64>,
    segment_base: i64,
    segment_bytes: i64,
    segment_ms: i64,
) -> PyResult<bool> {
    for item in items {
        let batch_size = item.batch_length as i64 + LENGTH_FIELD_END;
        let length = item.view.bytes().len() as i64;
        if batch_size != length {
            return Err(atomlog_error(
                py,
                "CORRUPT_BATCH",
                format!("batch_length says {} bytes, the batch has {}", batch_size, length),
                &[],
            ));
        }
        if batch_size > max_batch_bytes {
            return Err(atomlog_error(
                py,
                "BATCH_TOO_LARGE",
                format!("batch of {} bytes exceeds the limit of {} bytes", batch_size, max_batch_bytes),
                &[("limit", max_batch_bytes.to_string())],
            ));
        }
    }
    // PartitionLog._rolls for each batch, none copied.
    let (mut offset, mut end, mut first) = (next_offset as i128, size as i128, first_time);
    for item in items {
        let batch_size = item.batch_length as i128 + LENGTH_FIELD_END as i128;
        if end != 0
            && (offset - segment_base as i128 > SEGMENT_OFFSETS_MAX as i128
                || end + batch_size > segment_bytes as i128
                || first.map_or(false, |first| now as i128 - first as i128 >= segment_ms as i128))
        {
            return Ok(false);
        }
        end += batch_size;
        offset += item.last_offset_delta as i128 + 1;
        first = first.or(Some(now));
    }
    Ok(true)
}

/// record_batch.plan_log_append: a log's append of whole batches, checked, stamped and
/// accounted for; None when a batch would roll the segment.
#[pyfunction]
#[pyo3(signature = (group, next_offset, now, max_batch_bytes, size, first_time, segment_base,
                    segment_bytes, segment_ms, interval_bytes, last_indexed, running_max_ts))]
#[allow(clippy::too_many_arguments)]
fn plan_log_append(
    py: Python<'_>,
    group: &Bound<'_, PyAny>,
    next_offset: i64,
    now: i64,
    max_batch_bytes: i64,
    size: i64,
    first_time: Option<i64>,
    segment_base: i64,
    segment_bytes: i64,
    segment_ms: i64,
    interval_bytes: i64,
    last_indexed: Option<i64>,
    running_max_ts: i64,
) -> PyResult<Option<PyObject>> {
    let items = log_items(group)?;
    if !check_log_append(py, &items, next_offset, now, max_batch_bytes, size, first_time,
                         segment_base, segment_bytes, segment_ms)? {
        return Ok(None);
    }
    let (buffers, stamped, after) = stamp_items(py, &items, next_offset, now)?;
    // Segment.observe and SparseIndex.observe for each batch.
    let mut starts = Vec::with_capacity(items.len());
    let mut entries = Vec::new();
    let (mut position, mut last_indexed, mut running) = (size, last_indexed, running_max_ts);
    let (mut max_ts, mut last_data) = (i64::MIN, None);
    let mut base = next_offset;
    for item in &items {
        starts.push(PyTuple::new(py, [base, position])?);
        if last_indexed.map_or(true, |last| position - last >= interval_bytes) {
            entries.push(PyTuple::new(py, [base, position, running])?);
            last_indexed = Some(position);
        }
        running = running.max(item.max_timestamp_ms);
        max_ts = max_ts.max(item.max_timestamp_ms);
        if item.attributes & ATTR_CONTROL == 0 {
            last_data = Some(base + item.last_offset_delta as i64);
        }
        position += item.batch_length as i64 + LENGTH_FIELD_END;
        base += item.last_offset_delta as i64 + 1;
    }
    let plan = PyTuple::new(
        py,
        [
            buffers,
            pyo3::types::PyList::new(py, stamped)?.into_any().unbind(),
            after.into_pyobject(py)?.into_any().unbind(),
            pyo3::types::PyList::new(py, starts)?.into_any().unbind(),
            pyo3::types::PyList::new(py, entries)?.into_any().unbind(),
            position.into_pyobject(py)?.into_any().unbind(),
            running.into_pyobject(py)?.into_any().unbind(),
            max_ts.into_pyobject(py)?.into_any().unbind(),
            last_data.into_pyobject(py)?.into_any().unbind(),
        ],
    )?;
    Ok(Some(plan.into_any().unbind()))
}

// --- The records block of a small batch (record_columns.plain_block) --------------------------

/// One binary column's buffers, as record_columns._binary_buffers gives them: (null count,
/// validity bitmap, int32 offsets, data); None where pyarrow must convert (an item neither
/// bytes-like nor None, a buffer whose len() is not its byte size, over 2 GiB of data).
fn binary_buffers(items: &[Bound<'_, PyAny>]) -> PyResult<Option<(i64, Vec<u8>, Vec<u8>, Vec<u8>)>> {
    let n = items.len();
    let nulls = items.iter().filter(|item| item.is_none()).count();
    if nulls == n {
        return Ok(Some((n as i64, vec![0u8; (n + 7) / 8], vec![0u8; 4 * (n + 1)], Vec::new())));
    }
    let mut data = Vec::new();
    let mut lengths = Vec::with_capacity(n);
    for item in items {
        if item.is_none() {
            lengths.push(0usize);
            continue;
        }
        if let Ok(bytes) = item.downcast::<PyBytes>() {
            data.extend_from_slice(bytes.as_bytes());
        } else {
            match SimpleBuffer::get(item) {
                Ok(view) => data.extend_from_slice(view.bytes()),
                Err(_) => return Ok(None), // b"".join's TypeError
            }
        }
        match item.len() {
            Ok(length) => lengths.push(length),
            Err(_) => return Ok(None), // len()'s TypeError
        }
    }
    if data.len() != lengths.iter().sum::<usize>() || data.len() > 0x7FFF_FFFF {
        return Ok(None);
    }
    let mut offsets = Vec::with_capacity(4 * (n + 1));
    let mut at: i32 = 0;
    offsets.extend_from_slice(&at.to_le_bytes());
    for length in &lengths {
        at += *length as i32;
        offsets.extend_from_slice(&at.to_le_bytes());
    }
    if nulls == 0 {
        return Ok(Some((0, Vec::new(), offsets, data)));
    }
    let mut bitmap = vec![0u8; (n + 7) / 8];
    for (i, item) in items.iter().enumerate() {
        if !item.is_none() {
            bitmap[i >> 3] |= 1 << (i & 7);
        }
    }
    Ok(Some((nulls as i64, bitmap, offsets, data)))
}

/// record_columns.plain_block: the uncompressed Arrow IPC records block of `records`
/// (Record tuples; `stamps` their timestamps, the first the base) written directly, or
/// None when pyarrow must write it (a record with headers, a key or value neither
/// bytes-like nor None). The same bytes, byte for byte (the layout is in record_columns).
#[pyfunction]
fn plain_block(py: Python<'_>, records: &Bound<'_, PyAny>, stamps: Vec<i64>) -> PyResult<Option<PyObject>> {
    let mut keys = Vec::new();
    let mut values = Vec::new();
    let mut any_headers = false;
    for record in records.try_iter()? {
        let record = record?;
        keys.push(record.get_item(0)?);
        values.push(record.get_item(1)?);
        if record.get_item(2)?.is_truthy()? {
            any_headers = true;
        }
    }
    let n = keys.len();
    if n == 0 {
        return Err(PyValueError::new_err("not enough values to unpack (expected 3, got 0)"));
    }
    if any_headers {
        return Ok(None);
    }
    // (No let-else: Debian 12's rustc 1.63 builds this crate.)
    let keys = match binary_buffers(&keys)? {
        Some(keys) => keys,
        None => return Ok(None),
    };
    let values = match binary_buffers(&values)? {
        Some(values) => values,
        None => return Ok(None),
    };
    if stamps.len() != n {
        return Err(struct_error(py, &format!("pack expected {} items for packing (got {})", n, stamps.len())));
    }
    let base = stamps[0];
    let mut deltas = vec![0u8; 8 * n];
    if stamps.iter().any(|stamp| *stamp != base) {
        for (i, stamp) in stamps.iter().enumerate() {
            let delta = stamp.checked_sub(base).ok_or_else(|| struct_error(py, "argument out of range"))?;
            deltas[8 * i..8 * i + 8].copy_from_slice(&delta.to_le_bytes());
        }
    }
    let list_offsets = vec![0u8; 4 * (n + 1)];
    let empty_offsets = vec![0u8; 4];
    let nothing: Vec<u8> = Vec::new();
    // key (validity, offsets, data), value (the same), timestamp_delta (validity, data),
    // headers (validity, offsets), the header struct (validity), its key string and value
    // binary (validity, offsets, data each; 0 long).
    let buffers: [&[u8]; 17] = [
        &keys.1, &keys.2, &keys.3, &values.1, &values.2, &values.3, &nothing, &deltas,
        &nothing, &list_offsets, &nothing, &nothing, &empty_offsets, &nothing, &nothing,
        &empty_offsets, &nothing,
    ];
    let mut spans = Vec::with_capacity(34);
    let mut at: i64 = 0;
    for buffer in &buffers {
        let size = buffer.len() as i64;
        spans.push(at);
        spans.push(size);
        if size > 0 {
            at += size + (-size).rem_euclid(8);
        }
    }
    let mut meta: Vec<u8> = Vec::with_capacity(PLAIN_META_SIZE);
    let u16s = |meta: &mut Vec<u8>, values: &[u16]| values.iter().for_each(|v| meta.extend_from_slice(&v.to_le_bytes()));
    let i64s = |meta: &mut Vec<u8>, values: &[i64]| values.iter().for_each(|v| meta.extend_from_slice(&v.to_le_bytes()));
    // "<I6H": the root offset -> the Message table at 16; the Message vtable.
    meta.extend_from_slice(&16u32.to_le_bytes());
    u16s(&mut meta, &[12, 24, 4, 6, 16, 8]);
    // "ihBxqI4x": the Message table: its vtable 12 back, version V5, RecordBatch, pad,
    // bodyLength, the header 24 on (at 56), pad.
    meta.extend_from_slice(&12i32.to_le_bytes());
    meta.extend_from_slice(&4i16.to_le_bytes());
    meta.push(3);
    meta.push(0);
    meta.extend_from_slice(&at.to_le_bytes());
    meta.extend_from_slice(&24u32.to_le_bytes());
    meta.extend_from_slice(&[0u8; 4]);
    // "5H6x": the RecordBatch vtable, pad.
    u16s(&mut meta, &[10, 24, 8, 16, 20]);
    meta.extend_from_slice(&[0u8; 6]);
    // "i4xqII4x": the RecordBatch table: its vtable 16 back, pad, length, the nodes 12 on
    // (at 84) and the buffers 128 on (at 204), pad.
    meta.extend_from_slice(&16i32.to_le_bytes());
    meta.extend_from_slice(&[0u8; 4]);
    meta.extend_from_slice(&(n as i64).to_le_bytes());
    meta.extend_from_slice(&12u32.to_le_bytes());
    meta.extend_from_slice(&128u32.to_le_bytes());
    meta.extend_from_slice(&[0u8; 4]);
    // "I14q4x": 7 FieldNodes (length, null count), pad.
    meta.extend_from_slice(&7u32.to_le_bytes());
    let n = n as i64;
    i64s(&mut meta, &[n, keys.0, n, values.0, n, 0, n, 0, 0, 0, 0, 0, 0, 0]);
    meta.extend_from_slice(&[0u8; 4]);
    // "I34q": 17 Buffers (offset, length).
    meta.extend_from_slice(&17u32.to_le_bytes());
    i64s(&mut meta, &spans);
    debug_assert_eq!(meta.len(), PLAIN_META_SIZE);
    let total = 8 + PLAIN_META_SIZE + at as usize;
    let block = PyBytes::new_with(py, total, |out| {
        out[0..4].copy_from_slice(&0xFFFF_FFFFu32.to_le_bytes());
        out[4..8].copy_from_slice(&(PLAIN_META_SIZE as i32).to_le_bytes());
        out[8..8 + PLAIN_META_SIZE].copy_from_slice(&meta);
        let mut at = 8 + PLAIN_META_SIZE;
        for buffer in &buffers {
            out[at..at + buffer.len()].copy_from_slice(buffer);
            at += buffer.len();
            at += (8 - buffer.len() % 8) % 8; // zeros (PyBytes::new_with starts zeroed)
        }
        Ok(())
    })?;
    Ok(Some(block.into_any().unbind()))
}

/// record_columns._META_SIZE.
const PLAIN_META_SIZE: usize = 480;

/// A batch's bytes held for a while: bytes as they are, else a simple buffer.
enum BatchBytes<'py> {
    Bytes(Bound<'py, PyBytes>),
    Buffer(SimpleBuffer),
}

impl<'py> BatchBytes<'py> {
    fn of(object: &Bound<'py, PyAny>) -> PyResult<BatchBytes<'py>> {
        match object.downcast::<PyBytes>() {
            Ok(bytes) => Ok(BatchBytes::Bytes(bytes.clone())),
            Err(_) => Ok(BatchBytes::Buffer(SimpleBuffer::get(object)?)),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            BatchBytes::Bytes(bytes) => bytes.as_bytes(),
            BatchBytes::Buffer(buffer) => buffer.bytes(),
        }
    }
}

// --- Metric cells (services/fastmetrics.py) --------------------------------------------------

/// services.fastmetrics._CounterChild's value, in one cell: `inc` adds, `get` reads. The
/// GIL is held for each call, so no update is lost whatever the Python threads; the value
/// is an f64 kept in an atomic only to be shareable.
#[pyclass(frozen, module = "partition_server._native")]
struct CounterCell {
    value: AtomicU64,
}

#[pymethods]
impl CounterCell {
    #[new]
    fn new() -> Self {
        CounterCell { value: AtomicU64::new(0f64.to_bits()) }
    }

    #[pyo3(signature = (amount = 1.0))]
    fn inc(&self, amount: f64) -> PyResult<()> {
        if amount < 0.0 {
            return Err(PyValueError::new_err(
                "Counters can only be incremented by non-negative amounts.",
            ));
        }
        add(&self.value, amount);
        Ok(())
    }

    fn get(&self) -> f64 {
        f64::from_bits(self.value.load(Ordering::Relaxed))
    }

    /// [value], as _Child._sum gives.
    fn _sum(&self) -> Vec<f64> {
        vec![self.get()]
    }
}

/// services.fastmetrics._HistogramChild's values: the sum, then a count per bucket (the
/// first bound at or above the value, as bisect_left finds it).
#[pyclass(frozen, module = "partition_server._native")]
struct HistogramCell {
    bounds: Vec<f64>,
    sum: AtomicU64,
    counts: Vec<AtomicU64>,
}

#[pymethods]
impl HistogramCell {
    #[new]
    fn new(bounds: Vec<f64>) -> Self {
        let counts = (0..bounds.len()).map(|_| AtomicU64::new(0)).collect();
        HistogramCell { bounds, sum: AtomicU64::new(0f64.to_bits()), counts }
    }

    fn observe(&self, amount: f64) -> PyResult<()> {
        add(&self.sum, amount);
        let bucket = self.bounds.partition_point(|bound| *bound < amount);
        match self.counts.get(bucket) {
            Some(count) => {
                count.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // (bisect_left past the last bound: an index Python's list refuses too)
            None => Err(pyo3::exceptions::PyIndexError::new_err("list index out of range")),
        }
    }

    /// [sum, count per bucket...], as _Child._sum gives.
    fn _sum(&self) -> Vec<f64> {
        let mut out = Vec::with_capacity(1 + self.counts.len());
        out.push(f64::from_bits(self.sum.load(Ordering::Relaxed)));
        out.extend(self.counts.iter().map(|count| count.load(Ordering::Relaxed) as f64));
        out
    }
}

fn add(cell: &AtomicU64, amount: f64) {
    let value = f64::from_bits(cell.load(Ordering::Relaxed)) + amount;
    cell.store(value.to_bits(), Ordering::Relaxed);
}

fn put_uvarint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7F) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn put_zvarint(out: &mut Vec<u8>, n: i64) {
    put_uvarint(out, ((n << 1) ^ (n >> 63)) as u64);
}

/// A record's key or value for row_block: Some(None) for None, Some(Some(bytes)) for a
/// bytes object (exactly), None for anything else (the caller encodes it in Python).
fn bytes_or_none<'py>(item: Bound<'py, PyAny>) -> PyResult<Option<Option<Bound<'py, PyBytes>>>> {
    if item.is_none() {
        return Ok(Some(None));
    }
    if item.is_exact_instance_of::<PyBytes>() {
        return Ok(Some(Some(item.downcast_into::<PyBytes>()?)));
    }
    Ok(None)
}

/// record_batch.row_block: the uncompressed row-format records block of `records`
/// (Record tuples; `deltas` their timestamp deltas, their places their offset deltas),
/// or None where the caller encodes them one by one (a record with headers, a key or
/// value neither bytes nor None, a delta beyond 64 bits). The same bytes, byte for
/// byte; the same ValueError when the two lengths differ.
#[pyfunction]
fn row_block(py: Python<'_>, records: &Bound<'_, PyAny>, deltas: &Bound<'_, PyAny>) -> PyResult<Option<PyObject>> {
    let mut out: Vec<u8> = Vec::new();
    let mut records_iter = records.try_iter()?;
    let mut deltas_iter = deltas.try_iter()?;
    let mut index: u64 = 0;
    loop {
        let record = match records_iter.next() {
            Some(record) => record?,
            None => {
                return match deltas_iter.next() {
                    Some(_) => Err(PyValueError::new_err("zip() argument 2 is longer than argument 1")),
                    None => Ok(Some(PyBytes::new(py, &out).into_any().unbind())),
                };
            }
        };
        let delta = match deltas_iter.next() {
            Some(delta) => delta?,
            None => return Err(PyValueError::new_err("zip() argument 2 is shorter than argument 1")),
        };
        if record.get_item(2)?.is_truthy()? {
            return Ok(None);
        }
        let key = match bytes_or_none(record.get_item(0)?)? {
            Some(key) => key,
            None => return Ok(None),
        };
        let value = match bytes_or_none(record.get_item(1)?)? {
            Some(value) => value,
            None => return Ok(None),
        };
        let delta: i64 = match delta.extract() {
            Ok(delta) => delta,
            Err(_) => return Ok(None),
        };
        // attributes (0), timestamp delta, offset delta, key length; value length; no headers
        let mut head: Vec<u8> = Vec::with_capacity(32);
        head.push(0);
        put_zvarint(&mut head, delta);
        put_uvarint(&mut head, index);
        match &key {
            None => put_zvarint(&mut head, -1),
            Some(key) => put_zvarint(&mut head, key.as_bytes().len() as i64),
        }
        let mut value_length: Vec<u8> = Vec::with_capacity(10);
        match &value {
            None => put_zvarint(&mut value_length, -1),
            Some(value) => put_zvarint(&mut value_length, value.as_bytes().len() as i64),
        }
        let key_bytes: &[u8] = key.as_ref().map(|k| k.as_bytes()).unwrap_or(&[]);
        let value_bytes: &[u8] = value.as_ref().map(|v| v.as_bytes()).unwrap_or(&[]);
        let size = head.len() + value_length.len() + 1 + key_bytes.len() + value_bytes.len();
        put_uvarint(&mut out, size as u64);
        out.extend_from_slice(&head);
        out.extend_from_slice(key_bytes);
        out.extend_from_slice(&value_length);
        out.extend_from_slice(value_bytes);
        out.push(0); // no headers
        index += 1;
    }
}

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    // The SHA-256 of the crate's sources (scripts/build_native.sh sets it for the build;
    // cargo builds again when it changes): native.py uses a module only when it matches.
    module.add("SOURCES_DIGEST", option_env!("ATOMLOG_NATIVE_SOURCES").unwrap_or(""))?;
    module.add_function(wrap_pyfunction!(init, module)?)?;
    module.add_function(wrap_pyfunction!(parse_header, module)?)?;
    module.add_function(wrap_pyfunction!(verify_crc, module)?)?;
    module.add_function(wrap_pyfunction!(validate_batch, module)?)?;
    module.add_function(wrap_pyfunction!(stamp_transaction, module)?)?;
    module.add_function(wrap_pyfunction!(frame_batch_parsed, module)?)?;
    module.add_function(wrap_pyfunction!(stamp_for_log, module)?)?;
    module.add_function(wrap_pyfunction!(plan_log_append, module)?)?;
    module.add_function(wrap_pyfunction!(log_append::log_append_step, module)?)?;
    module.add_class::<log_append::AppendFacts>()?;
    module.add_function(wrap_pyfunction!(plain_block, module)?)?;
    module.add_function(wrap_pyfunction!(row_block, module)?)?;
    module.add_class::<CounterCell>()?;
    module.add_class::<HistogramCell>()?;
    module.add_class::<producer_state::ProducerStateTable>()?;
    module.add_class::<txn_buffer::TxnBuffer>()?;
    module.add_class::<txn_guard::TxnGuard>()?;
    module.add_function(wrap_pyfunction!(write_step::decide_write_step, module)?)?;
    module.add_function(wrap_pyfunction!(records::init_records, module)?)?;
    module.add_function(wrap_pyfunction!(records::encode_record, module)?)?;
    Ok(())
}
