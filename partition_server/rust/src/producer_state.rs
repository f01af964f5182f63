//! partition_server/producer_state.py's ProducerStateTable in Rust: the idempotent-producer
//! state of one partition, kept in Rust structs so that the write path's `check` and
//! `apply` (per batch, per marker) create no Python object but their answer.
//!
//! The Python class stays the reference (its module doc is the contract); this one is a
//! drop-in replacement: the same constructor, methods, properties and answers, made of
//! that module's own objects (APPEND, Duplicate, ProducerEntry, BatchMetadata,
//! ProducerStateMetrics), the same AtomlogError (reason, message, metadata), the same
//! AssertionError arguments, byte-identical snapshots. tests/test_native_producer_state.py
//! holds the two together on random operation sequences.
//!
//! Where an answer is an error whose exact text belongs to the reference (a header field
//! out of range, a BatchMetadata that cannot be, a snapshot that cannot be read or
//! written), the Python function that raises it is called on that (cold) path, so the
//! error is the reference's own.
//!
//! Integers: Python's are unbounded. Producer ids, epochs and sequences are checked
//! against their ranges as Python checks them (any int); offsets and timestamps are held
//! as i128 (the snapshot format holds i64: beyond it, `snapshot` raises struct.error as
//! the reference does). An offset or timestamp beyond i128 raises OverflowError, where
//! the reference would take it.

use pyo3::exceptions::{PyAssertionError, PyOverflowError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::collections::{HashMap, VecDeque};

const SEQUENCE_MODULUS: i64 = 1 << 31;
const SEQUENCE_MAX: i64 = SEQUENCE_MODULUS - 1;
const NO_SEQUENCE: i64 = -1;
const NO_PRODUCER_ID: i64 = 0;
const PRODUCER_ID_MAX: i64 = i64::MAX;
const PRODUCER_EPOCH_MAX: i64 = (1 << 32) - 1;
const DEFAULT_WINDOW: i128 = 5;
const WINDOW_MAX: i128 = 255;
const LIMIT_NAME: &str = "partition.max_producers";
const EVICT_IDLE_MS: i128 = 3_600_000;

// Snapshot format (producer_state.py's table): header, entries, batches, CRC32C trailer.
const SNAPSHOT_MAGIC: &[u8; 4] = b"ALPS";
const SNAPSHOT_VERSION: u16 = 1;
const HEADER_SIZE: usize = 20; // <4sHHqI
const ENTRY_SIZE: usize = 21; // <qIqB
const BATCH_SIZE: usize = 32; // <iiqqq
const TRAILER_SIZE: usize = 4;

/// ProducerStateMetrics' fields, in its order.
const COUNTERS: [&str; 8] = [
    "duplicates_total",
    "out_of_order_total",
    "fenced_total",
    "unknown_producer_total",
    "exhausted_total",
    "expired_total",
    "evicted_total",
    "anomalies_total",
];
const DUPLICATES: usize = 0;
const OUT_OF_ORDER: usize = 1;
const FENCED: usize = 2;
const UNKNOWN_PRODUCER: usize = 3;
const EXHAUSTED: usize = 4;
const EXPIRED: usize = 5;
const EVICTED: usize = 6;
const ANOMALIES: usize = 7;

/// The objects of partition_server.producer_state the answers are made of.
struct Refs {
    append: Py<PyAny>,
    duplicate: Py<PyAny>,
    entry: Py<PyAny>,
    batch: Py<PyAny>,
    metrics: Py<PyAny>,
    error: Py<PyAny>,
    validate_header: Py<PyAny>,
    decode_snapshot: Py<PyAny>,
    encode_snapshot: Py<PyAny>,
    mapping_proxy: Py<PyAny>,
}

static REFS: GILOnceCell<Refs> = GILOnceCell::new();

fn refs(py: Python<'_>) -> PyResult<&Refs> {
    REFS.get_or_try_init(py, || {
        let module = py.import("partition_server.producer_state")?;
        let get = |name: &str| -> PyResult<Py<PyAny>> { Ok(module.getattr(name)?.unbind()) };
        Ok(Refs {
            append: get("APPEND")?,
            duplicate: get("Duplicate")?,
            entry: get("ProducerEntry")?,
            batch: get("BatchMetadata")?,
            metrics: get("ProducerStateMetrics")?,
            error: get("AtomlogError")?,
            validate_header: get("_validate_header")?,
            decode_snapshot: get("decode_snapshot")?,
            encode_snapshot: get("encode_snapshot")?,
            mapping_proxy: py.import("types")?.getattr("MappingProxyType")?.unbind(),
        })
    })
}

// --- Integers from and to Python --------------------------------------------------------

/// An int as i128: i64 first (the fast path), i128 when it is beyond; None when it is an
/// int beyond i128 too. Not an int: the TypeError of the conversion.
fn wide(object: &Bound<'_, PyAny>) -> PyResult<Option<i128>> {
    match object.extract::<i64>() {
        Ok(value) => Ok(Some(value as i128)),
        Err(error) if error.is_instance_of::<PyOverflowError>(object.py()) => {
            match object.extract::<i128>() {
                Ok(value) => Ok(Some(value)),
                Err(error) if error.is_instance_of::<PyOverflowError>(object.py()) => Ok(None),
                Err(error) => Err(error),
            }
        }
        Err(error) => Err(error),
    }
}

/// An offset or timestamp: an int within i128, else OverflowError.
fn wide_required(object: &Bound<'_, PyAny>) -> PyResult<i128> {
    match wide(object)? {
        Some(value) => Ok(value),
        None => Err(PyOverflowError::new_err(
            "partition_server._native.ProducerStateTable holds offsets and timestamps \
             within 128 bits",
        )),
    }
}

/// An int in [minimum, maximum], or None (out of range, or not an int: the caller lets
/// the reference raise).
fn ranged(object: &Bound<'_, PyAny>, minimum: i64, maximum: i64) -> Option<i64> {
    match object.extract::<i64>() {
        Ok(value) if minimum <= value && value <= maximum => Some(value),
        _ => None,
    }
}

fn int_object(py: Python<'_>, value: i128) -> PyResult<PyObject> {
    if value >= i64::MIN as i128 && value <= i64::MAX as i128 {
        Ok((value as i64).into_pyobject(py)?.into_any().unbind())
    } else {
        Ok(value.into_pyobject(py)?.into_any().unbind())
    }
}

/// `now - last > limit`, exactly (as Python's unbounded ints compute it).
fn idle_over(now: i128, last: i128, limit: i128) -> bool {
    match now.checked_sub(last) {
        Some(idle) => idle > limit,
        None => now > last,
    }
}

fn sequence_add(sequence: i64, delta: i64) -> i64 {
    (sequence + delta).rem_euclid(SEQUENCE_MODULUS)
}

/// `assert <condition>, value`: AssertionError(value), as Python raises it.
fn assertion(py: Python<'_>, value: PyObject) -> PyErr {
    match py.get_type::<PyAssertionError>().call1((value,)) {
        Ok(error) => PyErr::from_value(error),
        Err(error) => error,
    }
}

fn pair(py: Python<'_>, first: PyObject, second: PyObject) -> PyResult<PyObject> {
    Ok(PyTuple::new(py, [first, second])?.into_any().unbind())
}

fn atomlog_error(py: Python<'_>, reason: &str, message: String, metadata: &[(&str, String)]) -> PyErr {
    match refs(py) {
        Ok(refs) => crate::new_atomlog_error(py, &refs.error, reason, message, metadata),
        Err(error) => error,
    }
}

// --- The state -------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
struct Batch {
    base_sequence: i64,
    last_sequence: i64,
    base_offset: i128,
    last_offset: i128,
    timestamp_ms: i128,
}

#[derive(Clone, Debug)]
struct Entry {
    epoch: i64,
    last_timestamp_ms: i128,
    /// Where the entry stands in the reference's dict (insertion order): a new key goes
    /// last, a replaced value keeps its place.
    order: u64,
    batches: VecDeque<Batch>,
}

impl Entry {
    fn last_sequence(&self) -> i64 {
        match self.batches.back() {
            Some(batch) => batch.last_sequence,
            None => NO_SEQUENCE,
        }
    }

    fn next_sequence(&self) -> i64 {
        match self.batches.back() {
            Some(batch) => sequence_add(batch.last_sequence, 1),
            None => 0,
        }
    }

    fn find_batch(&self, base_sequence: i64, last_sequence: i64) -> Option<&Batch> {
        self.batches
            .iter()
            .find(|batch| batch.base_sequence == base_sequence && batch.last_sequence == last_sequence)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    NewProducer,
    UnknownProducer,
    Fenced,
    NewEpoch,
    NewEpochNotZero,
    Duplicate,
    InOrder,
    NotFromZero,
    Gap,
    TooOld,
}

impl Verdict {
    fn accepted(self) -> bool {
        matches!(self, Verdict::NewProducer | Verdict::NewEpoch | Verdict::InOrder)
    }
}

/// producer_state.judge.
fn judge(entry: Option<&Entry>, epoch: i64, base_sequence: i64, batch_last_sequence: i64) -> Verdict {
    let entry = match entry {
        None => {
            return if base_sequence == 0 { Verdict::NewProducer } else { Verdict::UnknownProducer };
        }
        Some(entry) => entry,
    };
    if epoch < entry.epoch {
        return Verdict::Fenced;
    }
    if epoch > entry.epoch {
        return if base_sequence == 0 { Verdict::NewEpoch } else { Verdict::NewEpochNotZero };
    }
    if entry.find_batch(base_sequence, batch_last_sequence).is_some() {
        return Verdict::Duplicate;
    }
    if entry.batches.is_empty() {
        return if base_sequence == 0 { Verdict::InOrder } else { Verdict::NotFromZero };
    }
    let next = entry.next_sequence();
    if base_sequence == next {
        return Verdict::InOrder;
    }
    let ahead = (base_sequence - next).rem_euclid(SEQUENCE_MODULUS);
    if ahead < SEQUENCE_MODULUS / 2 {
        Verdict::Gap
    } else {
        Verdict::TooOld
    }
}

/// producer_state.ProducerStateTable, natively.
#[pyclass(module = "partition_server._native", name = "ProducerStateTable")]
pub struct ProducerStateTable {
    max_producers: i128,
    idle_expiry_ms: i128,
    window: usize,
    evict_idle_ms: i128,
    entries: HashMap<i64, Entry>,
    next_order: u64,
    counters: [u64; 8],
    last_applied_offset: i128,
    /// Restored from the reference's decoding of a snapshot (not in bytes, or refused by
    /// `decode` yet read by the reference: a bug of `decode`, which the tests look for).
    restored_by_reference: bool,
}

impl ProducerStateTable {
    fn build(
        py: Python<'_>,
        max_producers: &Bound<'_, PyAny>,
        idle_expiry_ms: &Bound<'_, PyAny>,
        window: Option<&Bound<'_, PyAny>>,
        evict_idle_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        refs(py)?;
        // __post_init__'s assertions, in its order.
        let max = wide(max_producers)?;
        let max = match max {
            Some(value) if value >= 1 => value,
            Some(_) => return Err(assertion(py, max_producers.clone().unbind())),
            None if max_producers.gt(0)? => {
                return Err(PyOverflowError::new_err("max_producers beyond 128 bits"));
            }
            None => return Err(assertion(py, max_producers.clone().unbind())),
        };
        let idle = match wide(idle_expiry_ms)? {
            Some(value) if value >= 0 => value,
            Some(_) => return Err(assertion(py, idle_expiry_ms.clone().unbind())),
            None if idle_expiry_ms.gt(0)? => {
                return Err(PyOverflowError::new_err("idle_expiry_ms beyond 128 bits"));
            }
            None => return Err(assertion(py, idle_expiry_ms.clone().unbind())),
        };
        let window_value = match window {
            None => DEFAULT_WINDOW,
            Some(object) => match wide(object)? {
                Some(value) if (1..=WINDOW_MAX).contains(&value) => value,
                _ => return Err(assertion(py, object.clone().unbind())),
            },
        };
        let evict = match evict_idle_ms {
            Some(object) if !object.is_none() => match wide(object)? {
                Some(value) if 0 <= value && value <= idle => value,
                _ => return Err(assertion(py, object.clone().unbind())),
            },
            _ => EVICT_IDLE_MS.min(idle),
        };
        Ok(ProducerStateTable {
            max_producers: max,
            idle_expiry_ms: idle,
            window: window_value as usize,
            evict_idle_ms: evict,
            entries: HashMap::new(),
            next_order: 0,
            counters: [0; 8],
            last_applied_offset: -1,
            restored_by_reference: false,
        })
    }

    fn live(&self, producer_id: i64, now_ms: i128) -> Option<&Entry> {
        match self.entries.get(&producer_id) {
            Some(entry) if !idle_over(now_ms, entry.last_timestamp_ms, self.idle_expiry_ms) => Some(entry),
            _ => None,
        }
    }

    /// `_entries[producer_id] = entry`: a new key goes last, an old one keeps its place.
    fn put(&mut self, producer_id: i64, epoch: i64, last_timestamp_ms: i128, batches: VecDeque<Batch>) {
        match self.entries.get_mut(&producer_id) {
            Some(entry) => {
                entry.epoch = epoch;
                entry.last_timestamp_ms = last_timestamp_ms;
                entry.batches = batches;
            }
            None => {
                let order = self.next_order;
                self.next_order += 1;
                self.entries.insert(producer_id, Entry { epoch, last_timestamp_ms, order, batches });
            }
        }
    }

    /// The entries in the reference's dict order.
    fn ordered(&self) -> Vec<(i64, &Entry)> {
        let mut rows: Vec<(i64, &Entry)> = self.entries.iter().map(|(pid, entry)| (*pid, entry)).collect();
        rows.sort_unstable_by_key(|(_, entry)| entry.order);
        rows
    }

    /// Remove the producers idle for more than `limit` ms at `now_ms`; their ids.
    fn remove_idle(&mut self, now_ms: i128, limit: i128) -> Vec<i64> {
        let idle: Vec<i64> = self
            .entries
            .iter()
            .filter(|(_, entry)| idle_over(now_ms, entry.last_timestamp_ms, limit))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in &idle {
            self.entries.remove(pid);
        }
        idle
    }

    fn expire_at(&mut self, now_ms: i128) -> Vec<i64> {
        let mut expired = self.remove_idle(now_ms, self.idle_expiry_ms);
        self.counters[EXPIRED] += expired.len() as u64;
        expired.sort_unstable();
        expired
    }

    /// ProducerStateTable._make_room.
    fn make_room(&mut self, py: Python<'_>, producer_id: i64, now_ms: i128) -> PyResult<()> {
        if (self.entries.len() as i128) < self.max_producers {
            return Ok(());
        }
        self.expire_at(now_ms);
        if (self.entries.len() as i128) < self.max_producers {
            return Ok(());
        }
        let evict = self.evict_idle_ms;
        let idle = self.remove_idle(now_ms, evict);
        self.counters[EVICTED] += idle.len() as u64;
        if (self.entries.len() as i128) < self.max_producers {
            return Ok(());
        }
        self.counters[EXHAUSTED] += 1;
        let first_free_ms = self
            .entries
            .values()
            .map(|entry| entry.last_timestamp_ms)
            .min()
            .expect("a full table has entries");
        // max(first_free_ms + evict_idle_ms + 1 - now_ms, 1), in Python's ints
        let retry_after_ms = match first_free_ms
            .checked_add(evict)
            .and_then(|value| value.checked_add(1))
            .and_then(|value| value.checked_sub(now_ms))
        {
            Some(value) => value.max(1).to_string(),
            None => {
                let value = int_object(py, first_free_ms)?
                    .into_bound(py)
                    .add(int_object(py, evict)?)?
                    .add(1)?
                    .sub(int_object(py, now_ms)?)?;
                if value.lt(1)? { "1".to_string() } else { value.str()?.to_string() }
            }
        };
        Err(atomlog_error(
            py,
            "RESOURCE_EXHAUSTED",
            format!(
                "partition tracks {} producers, the limit {}={}, and none has been idle for more \
                 than {} ms: producer {} cannot be added",
                self.entries.len(),
                LIMIT_NAME,
                self.max_producers,
                evict,
                producer_id
            ),
            &[
                ("limit", LIMIT_NAME.to_string()),
                ("max_producers", self.max_producers.to_string()),
                ("retry_after_ms", retry_after_ms),
            ],
        ))
    }

    /// ProducerStateTable._reject: counts, and the error to raise.
    #[allow(clippy::too_many_arguments)]
    fn reject(
        &mut self,
        py: Python<'_>,
        verdict: Verdict,
        producer_id: i64,
        producer_epoch: i64,
        base_sequence: i64,
        batch_last_sequence: i64,
        now_ms: i128,
    ) -> PyErr {
        let (current_epoch, last_sequence, expected_sequence) = match self.live(producer_id, now_ms) {
            None => (-1, NO_SEQUENCE, 0),
            Some(entry) => (
                entry.epoch,
                entry.last_sequence(),
                if producer_epoch != entry.epoch { 0 } else { entry.next_sequence() },
            ),
        };
        let (pid, epoch) = (producer_id, producer_epoch);
        let (counter, reason, message) = match verdict {
            Verdict::UnknownProducer => (
                UNKNOWN_PRODUCER,
                "UNKNOWN_PRODUCER_ID",
                format!(
                    "producer {} has no state on this partition (never seen, or idle for more \
                     than {} ms): expected base sequence 0, received {}",
                    pid, self.idle_expiry_ms, base_sequence
                ),
            ),
            Verdict::Fenced => (
                FENCED,
                "PRODUCER_FENCED",
                format!(
                    "producer {} epoch {} is fenced: this partition has seen epoch {}",
                    pid, epoch, current_epoch
                ),
            ),
            Verdict::NewEpochNotZero => (
                OUT_OF_ORDER,
                "OUT_OF_ORDER_SEQUENCE",
                format!(
                    "producer {} epoch {} is new (previous epoch {}) and must start at sequence 0: \
                     expected base sequence 0, received {}",
                    pid, epoch, current_epoch, base_sequence
                ),
            ),
            Verdict::NotFromZero => (
                OUT_OF_ORDER,
                "OUT_OF_ORDER_SEQUENCE",
                format!(
                    "producer {} epoch {} has no batch in this epoch yet: expected base sequence \
                     0, received {}",
                    pid, epoch, base_sequence
                ),
            ),
            Verdict::Gap => (
                OUT_OF_ORDER,
                "OUT_OF_ORDER_SEQUENCE",
                format!(
                    "producer {} epoch {}: expected base sequence {}, received {} (a gap after \
                     sequence {})",
                    pid, epoch, expected_sequence, base_sequence, last_sequence
                ),
            ),
            Verdict::TooOld => (
                OUT_OF_ORDER,
                "OUT_OF_ORDER_SEQUENCE",
                format!(
                    "producer {} epoch {}: expected base sequence {}, received {}..{}, which is \
                     not one of the last {} batches, so it cannot be deduplicated",
                    pid, epoch, expected_sequence, base_sequence, batch_last_sequence, self.window
                ),
            ),
            _ => return PyRuntimeError::new_err(format!("{:?} is not a refusal", verdict)),
        };
        self.counters[counter] += 1;
        let third = if verdict == Verdict::Fenced {
            ("current_epoch", current_epoch.to_string())
        } else {
            ("expected_sequence", expected_sequence.to_string())
        };
        atomlog_error(
            py,
            reason,
            message,
            &[("producer_id", pid.to_string()), ("producer_epoch", epoch.to_string()), third],
        )
    }

    fn entry_object(&self, py: Python<'_>, producer_id: i64, entry: &Entry) -> PyResult<PyObject> {
        let refs = refs(py)?;
        let mut batches = Vec::with_capacity(entry.batches.len());
        for batch in &entry.batches {
            batches.push(batch_object(py, batch)?);
        }
        let batches = PyTuple::new(py, batches)?;
        refs.entry.call1(
            py,
            (producer_id, entry.epoch, int_object(py, entry.last_timestamp_ms)?, batches),
        )
    }

    fn entries_dict<'py>(&self, py: Python<'py>, now_ms: Option<i128>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (pid, entry) in self.ordered() {
            if let Some(now) = now_ms {
                if idle_over(now, entry.last_timestamp_ms, self.idle_expiry_ms) {
                    continue;
                }
            }
            dict.set_item(pid, self.entry_object(py, pid, entry)?)?;
        }
        Ok(dict)
    }

    /// The snapshot's bytes, or None when a value does not fit its i64 field (the caller
    /// lets the reference raise its struct.error).
    fn encode(&self, covered_offset: i128) -> Option<Vec<u8>> {
        fn q(value: i128) -> Option<[u8; 8]> {
            if value >= i64::MIN as i128 && value <= i64::MAX as i128 {
                Some((value as i64).to_le_bytes())
            } else {
                None
            }
        }
        let mut pids: Vec<i64> = self.entries.keys().copied().collect();
        pids.sort_unstable();
        let mut out = Vec::with_capacity(
            HEADER_SIZE + TRAILER_SIZE + pids.len() * (ENTRY_SIZE + self.window.min(8) * BATCH_SIZE),
        );
        out.extend_from_slice(SNAPSHOT_MAGIC);
        out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&[0u8; 8]); // covered offset: below, once the entries packed
        if pids.len() > u32::MAX as usize {
            return None;
        }
        out.extend_from_slice(&(pids.len() as u32).to_le_bytes());
        for pid in pids {
            let entry = &self.entries[&pid];
            out.extend_from_slice(&pid.to_le_bytes());
            out.extend_from_slice(&(entry.epoch as u32).to_le_bytes());
            out.extend_from_slice(&q(entry.last_timestamp_ms)?);
            out.push(entry.batches.len() as u8);
            for batch in &entry.batches {
                out.extend_from_slice(&(batch.base_sequence as i32).to_le_bytes());
                out.extend_from_slice(&(batch.last_sequence as i32).to_le_bytes());
                out.extend_from_slice(&q(batch.base_offset)?);
                out.extend_from_slice(&q(batch.last_offset)?);
                out.extend_from_slice(&q(batch.timestamp_ms)?);
            }
        }
        out[8..16].copy_from_slice(&q(covered_offset)?);
        let crc = crate::crc32c::value(&out, 0);
        out.extend_from_slice(&crc.to_le_bytes());
        Some(out)
    }
}

fn batch_object(py: Python<'_>, batch: &Batch) -> PyResult<PyObject> {
    refs(py)?.batch.call1(
        py,
        (
            batch.base_sequence,
            batch.last_sequence,
            int_object(py, batch.base_offset)?,
            int_object(py, batch.last_offset)?,
            int_object(py, batch.timestamp_ms)?,
        ),
    )
}

/// A decoded snapshot entry.
struct Decoded {
    producer_id: i64,
    epoch: i64,
    last_timestamp_ms: i128,
    batches: VecDeque<Batch>,
}

fn le<const N: usize>(data: &[u8], at: usize) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    out.copy_from_slice(data.get(at..at.checked_add(N)?)?);
    Some(out)
}

/// producer_state.decode_snapshot's answer, or None for a snapshot it refuses (the caller
/// lets the reference raise its SnapshotCorrupt).
fn decode(data: &[u8]) -> Option<(i64, Vec<Decoded>)> {
    if data.len() < HEADER_SIZE + TRAILER_SIZE || &data[..4] != SNAPSHOT_MAGIC {
        return None;
    }
    let body = &data[..data.len() - TRAILER_SIZE];
    let stored = u32::from_le_bytes(le(data, body.len())?);
    if crate::crc32c::value(body, 0) != stored {
        return None;
    }
    if u16::from_le_bytes(le(data, 4)?) != SNAPSHOT_VERSION || u16::from_le_bytes(le(data, 6)?) != 0 {
        return None;
    }
    let covered_offset = i64::from_le_bytes(le(data, 8)?);
    let count = u32::from_le_bytes(le(data, 16)?) as usize;
    let mut position = HEADER_SIZE;
    let mut entries: Vec<Decoded> = Vec::with_capacity(count.min(body.len() / ENTRY_SIZE));
    for _ in 0..count {
        let producer_id = i64::from_le_bytes(le(body, position)?);
        let epoch = u32::from_le_bytes(le(body, position + 8)?) as i64;
        let last_timestamp_ms = i64::from_le_bytes(le(body, position + 12)?) as i128;
        let batch_count = *body.get(position + 20)? as usize;
        position += ENTRY_SIZE;
        if producer_id <= 0 {
            return None;
        }
        let mut batches: VecDeque<Batch> = VecDeque::with_capacity(batch_count);
        for _ in 0..batch_count {
            let batch = Batch {
                base_sequence: i32::from_le_bytes(le(body, position)?) as i64,
                last_sequence: i32::from_le_bytes(le(body, position + 4)?) as i64,
                base_offset: i64::from_le_bytes(le(body, position + 8)?) as i128,
                last_offset: i64::from_le_bytes(le(body, position + 16)?) as i128,
                timestamp_ms: i64::from_le_bytes(le(body, position + 24)?) as i128,
            };
            position += BATCH_SIZE;
            if batch.base_sequence < 0 || batch.last_sequence < 0 {
                return None;
            }
            if !(0 <= batch.base_offset && batch.base_offset <= batch.last_offset) {
                return None;
            }
            let span = (batch.last_sequence - batch.base_sequence).rem_euclid(SEQUENCE_MODULUS) as i128;
            if span != batch.last_offset - batch.base_offset {
                return None;
            }
            if let Some(previous) = batches.back() {
                if batch.base_sequence != sequence_add(previous.last_sequence, 1)
                    || batch.base_offset <= previous.last_offset
                {
                    return None;
                }
            }
            batches.push_back(batch);
        }
        entries.push(Decoded { producer_id, epoch, last_timestamp_ms, batches });
    }
    if position != body.len() || covered_offset < 0 {
        return None;
    }
    for (index, entry) in entries.iter().enumerate() {
        if index > 0 && entry.producer_id <= entries[index - 1].producer_id {
            return None;
        }
        if let Some(last) = entry.batches.back() {
            if last.last_offset >= covered_offset as i128 {
                return None;
            }
        }
    }
    Some((covered_offset, entries))
}

#[pymethods]
impl ProducerStateTable {
    #[new]
    #[pyo3(signature = (max_producers, idle_expiry_ms, window = None, evict_idle_ms = None))]
    fn new(
        py: Python<'_>,
        max_producers: &Bound<'_, PyAny>,
        idle_expiry_ms: &Bound<'_, PyAny>,
        window: Option<&Bound<'_, PyAny>>,
        evict_idle_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Self::build(py, max_producers, idle_expiry_ms, window, evict_idle_ms)
    }

    #[getter]
    fn max_producers(&self, py: Python<'_>) -> PyResult<PyObject> {
        int_object(py, self.max_producers)
    }

    #[getter]
    fn idle_expiry_ms(&self, py: Python<'_>) -> PyResult<PyObject> {
        int_object(py, self.idle_expiry_ms)
    }

    #[getter]
    fn window(&self) -> usize {
        self.window
    }

    #[getter]
    fn evict_idle_ms(&self, py: Python<'_>) -> PyResult<PyObject> {
        int_object(py, self.evict_idle_ms)
    }

    /// Whether `restore` took the reference's decoding (see the field); for the tests.
    #[getter]
    fn _restored_by_reference(&self) -> bool {
        self.restored_by_reference
    }

    fn __repr__(&self) -> String {
        format!(
            "ProducerStateTable(max_producers={}, idle_expiry_ms={}, window={}, evict_idle_ms={})",
            self.max_producers, self.idle_expiry_ms, self.window, self.evict_idle_ms
        )
    }

    // -- observability ------------------------------------------------------------------

    /// Entries held in memory (expired ones stay until `expire` or a full table).
    #[getter]
    fn producer_count(&self) -> usize {
        self.entries.len()
    }

    #[getter]
    fn metrics(&self, py: Python<'_>) -> PyResult<PyObject> {
        let kwargs = PyDict::new(py);
        for (name, value) in COUNTERS.iter().zip(self.counters.iter()) {
            kwargs.set_item(*name, *value)?;
        }
        refs(py)?.metrics.call(py, (), Some(&kwargs))
    }

    #[getter]
    fn last_applied_offset(&self, py: Python<'_>) -> PyResult<PyObject> {
        int_object(py, self.last_applied_offset)
    }

    /// Every entry held, expired or not: a read-only mapping (a copy as of this call, not
    /// a live view as the reference's).
    fn entries(&self, py: Python<'_>) -> PyResult<PyObject> {
        let dict = self.entries_dict(py, None)?;
        refs(py)?.mapping_proxy.call1(py, (dict,))
    }

    /// The entries not expired at now_ms.
    fn live_entries(&self, py: Python<'_>, now_ms: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let now = wide_required(now_ms)?;
        Ok(self.entries_dict(py, Some(now))?.into_any().unbind())
    }

    /// The producer's entry if it is not expired at now_ms.
    fn entry(&self, py: Python<'_>, producer_id: &Bound<'_, PyAny>, now_ms: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let pid = match producer_id.extract::<i64>() {
            Ok(pid) => pid,
            Err(_) => return Ok(py.None()),
        };
        let now = wide_required(now_ms)?;
        match self.live(pid, now) {
            Some(entry) => self.entry_object(py, pid, entry),
            None => Ok(py.None()),
        }
    }

    // -- decisions ----------------------------------------------------------------------

    /// Decide a batch before it is appended; raise AtomlogError when it is refused.
    pub(crate) fn check(
        &mut self,
        py: Python<'_>,
        producer_id: &Bound<'_, PyAny>,
        producer_epoch: &Bound<'_, PyAny>,
        base_sequence: &Bound<'_, PyAny>,
        record_count: &Bound<'_, PyAny>,
        now_ms: &Bound<'_, PyAny>,
    ) -> PyResult<PyObject> {
        let fields = (
            ranged(producer_id, NO_PRODUCER_ID, PRODUCER_ID_MAX),
            ranged(producer_epoch, 0, PRODUCER_EPOCH_MAX),
            ranged(base_sequence, NO_SEQUENCE, SEQUENCE_MAX),
            ranged(record_count, 1, SEQUENCE_MAX),
        );
        let (pid, epoch, base, count) = match fields {
            (Some(pid), Some(epoch), Some(base), Some(count)) => (pid, epoch, base, count),
            _ => {
                // The reference's own check raises its own error.
                let refs = refs(py)?;
                refs.validate_header
                    .call1(py, (producer_id, producer_epoch, base_sequence, record_count))?;
                return Err(PyRuntimeError::new_err(
                    "ProducerStateTable.check: header fields the native table cannot hold",
                ));
            }
        };
        if pid == NO_PRODUCER_ID || base == NO_SEQUENCE {
            return Ok(refs(py)?.append.clone_ref(py));
        }
        let now = wide_required(now_ms)?;
        let batch_last_sequence = sequence_add(base, count - 1);
        let entry = self.live(pid, now);
        let verdict = judge(entry, epoch, base, batch_last_sequence);
        match verdict {
            Verdict::Duplicate => {
                let batch = *entry
                    .and_then(|entry| entry.find_batch(base, batch_last_sequence))
                    .expect("a duplicate's batch");
                self.counters[DUPLICATES] += 1;
                refs(py)?.duplicate.call1(
                    py,
                    (
                        int_object(py, batch.base_offset)?,
                        int_object(py, batch.last_offset)?,
                        int_object(py, batch.timestamp_ms)?,
                        batch.base_sequence,
                        batch.last_sequence,
                    ),
                )
            }
            Verdict::NewProducer => {
                self.make_room(py, pid, now)?;
                Ok(refs(py)?.append.clone_ref(py))
            }
            Verdict::NewEpoch | Verdict::InOrder => Ok(refs(py)?.append.clone_ref(py)),
            _ => Err(self.reject(py, verdict, pid, epoch, base, batch_last_sequence, now)),
        }
    }

    /// Record an appended batch (live, after the append; or in replay, per header).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (producer_id, producer_epoch, base_sequence, last_sequence, base_offset,
                        last_offset, timestamp_ms, *, control = None))]
    pub(crate) fn apply(
        &mut self,
        py: Python<'_>,
        producer_id: &Bound<'_, PyAny>,
        producer_epoch: &Bound<'_, PyAny>,
        base_sequence: &Bound<'_, PyAny>,
        last_sequence: &Bound<'_, PyAny>,
        base_offset: &Bound<'_, PyAny>,
        last_offset: &Bound<'_, PyAny>,
        timestamp_ms: &Bound<'_, PyAny>,
        control: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        // The reference's assertions, in its order.
        let refused = || -> PyResult<PyErr> {
            let args = pair(py, base_offset.clone().unbind(), last_offset.clone().unbind())?;
            Ok(assertion(py, args))
        };
        let (first, last) = match (wide(base_offset)?, wide(last_offset)?) {
            (Some(first), Some(last)) if 0 <= first && first <= last => (first, last),
            (Some(_), Some(_)) => return Err(refused()?),
            // (None: an int beyond i128, refused when negative, else beyond this table)
            (Some(first), None) if first < 0 || last_offset.lt(0)? => return Err(refused()?),
            (None, _) if base_offset.lt(0)? => return Err(refused()?),
            _ => {
                return Err(PyOverflowError::new_err(
                    "partition_server._native.ProducerStateTable holds offsets within 128 bits",
                ));
            }
        };
        if first <= self.last_applied_offset {
            let args = pair(py, base_offset.clone().unbind(), int_object(py, self.last_applied_offset)?)?;
            return Err(assertion(py, args));
        }
        let pid = match wide(producer_id)? {
            Some(pid) if 0 <= pid && pid <= PRODUCER_ID_MAX as i128 => pid as i64,
            _ => return Err(assertion(py, producer_id.clone().unbind())),
        };
        let epoch = match wide(producer_epoch)? {
            Some(epoch) if 0 <= epoch && epoch <= PRODUCER_EPOCH_MAX as i128 => epoch as i64,
            _ => return Err(assertion(py, producer_epoch.clone().unbind())),
        };
        self.last_applied_offset = last;
        if pid == NO_PRODUCER_ID {
            return Ok(());
        }
        let timestamp = wide_required(timestamp_ms)?;
        let control = match control {
            Some(control) => control.is_truthy()?,
            None => false,
        };
        let idle = self.idle_expiry_ms;
        let window = self.window;
        if control {
            // _after_marker: a new entry for an unknown (or expired) producer or a higher
            // epoch; the same epoch refreshes the time; a lower one is ignored.
            let fresh = match self.entries.get_mut(&pid) {
                Some(entry) if !idle_over(timestamp, entry.last_timestamp_ms, idle) => {
                    if epoch == entry.epoch {
                        entry.last_timestamp_ms = timestamp;
                    }
                    epoch > entry.epoch
                }
                _ => true,
            };
            if fresh {
                self.put(pid, epoch, timestamp, VecDeque::new());
            }
            return Ok(());
        }
        let base = base_sequence.extract::<i64>().ok();
        if base == Some(NO_SEQUENCE) {
            return Ok(());
        }
        let batch = match (base, last_sequence.extract::<i64>()) {
            (Some(base), Ok(last_seq))
                if (0..=SEQUENCE_MAX).contains(&base)
                    && (0..=SEQUENCE_MAX).contains(&last_seq)
                    && (last_seq - base).rem_euclid(SEQUENCE_MODULUS) as i128 == last - first =>
            {
                Batch {
                    base_sequence: base,
                    last_sequence: last_seq,
                    base_offset: first,
                    last_offset: last,
                    timestamp_ms: timestamp,
                }
            }
            _ => {
                // BatchMetadata's own assertion (after _last_applied_offset moved, as there).
                refs(py)?.batch.call1(
                    py,
                    (base_sequence, last_sequence, base_offset, last_offset, timestamp_ms),
                )?;
                return Err(PyRuntimeError::new_err(
                    "ProducerStateTable.apply: a batch the native table cannot hold",
                ));
            }
        };
        // _after_batch (one lookup of the producer on the way of an in-order batch)
        let live = match self.entries.get_mut(&pid) {
            Some(entry) if !idle_over(timestamp, entry.last_timestamp_ms, idle) => Some(entry),
            _ => None,
        };
        let verdict = judge(live.as_deref(), epoch, batch.base_sequence, batch.last_sequence);
        if verdict == Verdict::InOrder {
            let entry = live.expect("in order: a live entry");
            entry.epoch = epoch;
            entry.last_timestamp_ms = timestamp;
            entry.batches.push_back(batch);
            while entry.batches.len() > window {
                entry.batches.pop_front();
            }
            return Ok(());
        }
        if !verdict.accepted() {
            self.counters[ANOMALIES] += 1;
        }
        let mut batches = VecDeque::with_capacity(window.min(8));
        batches.push_back(batch);
        self.put(pid, epoch, timestamp, batches);
        Ok(())
    }

    /// Drop producers idle for more than idle_expiry_ms at now_ms; return their ids.
    fn expire(&mut self, py: Python<'_>, now_ms: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let now = wide_required(now_ms)?;
        let expired = self.expire_at(now);
        Ok(PyList::new(py, expired)?.into_any().unbind())
    }

    // -- snapshots ----------------------------------------------------------------------

    /// Encode the table; covered_offset is where replay resumes (exclusive end).
    fn snapshot(&self, py: Python<'_>, covered_offset: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let covered = wide_required(covered_offset)?;
        if covered <= self.last_applied_offset {
            let args = pair(py, covered_offset.clone().unbind(), int_object(py, self.last_applied_offset)?)?;
            return Err(assertion(py, args));
        }
        match self.encode(covered) {
            Some(data) => Ok(PyBytes::new(py, &data).into_any().unbind()),
            None => {
                // A value beyond the format's i64: the reference's encoding raises.
                let mut pids: Vec<i64> = self.entries.keys().copied().collect();
                pids.sort_unstable();
                let mut objects = Vec::with_capacity(pids.len());
                for pid in pids {
                    objects.push(self.entry_object(py, pid, &self.entries[&pid])?);
                }
                refs(py)?.encode_snapshot.call1(py, (covered_offset, PyList::new(py, objects)?))
            }
        }
    }

    /// Rebuild from a snapshot: (table, covered_offset). Raises SnapshotCorrupt.
    #[staticmethod]
    #[pyo3(signature = (data, max_producers, idle_expiry_ms, window = None))]
    fn restore(
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        max_producers: &Bound<'_, PyAny>,
        idle_expiry_ms: &Bound<'_, PyAny>,
        window: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Py<ProducerStateTable>, i64)> {
        let decoded = match data.downcast::<PyBytes>() {
            Ok(bytes) => decode(bytes.as_bytes()),
            Err(_) => None,
        };
        let by_reference = decoded.is_none();
        let (covered_offset, entries) = match decoded {
            Some(decoded) => decoded,
            None => {
                // The reference decodes (and raises its SnapshotCorrupt); a snapshot it
                // reads (one not in bytes) is taken from its answer.
                let answer = refs(py)?.decode_snapshot.call1(py, (data,))?.into_bound(py);
                let covered: i64 = answer.get_item(0)?.extract()?;
                let mut entries = Vec::new();
                for entry in answer.get_item(1)?.try_iter()? {
                    let entry = entry?;
                    let mut batches = VecDeque::new();
                    for batch in entry.getattr("batches")?.try_iter()? {
                        let batch = batch?;
                        batches.push_back(Batch {
                            base_sequence: batch.getattr("base_sequence")?.extract()?,
                            last_sequence: batch.getattr("last_sequence")?.extract()?,
                            base_offset: batch.getattr("base_offset")?.extract()?,
                            last_offset: batch.getattr("last_offset")?.extract()?,
                            timestamp_ms: batch.getattr("timestamp_ms")?.extract()?,
                        });
                    }
                    entries.push(Decoded {
                        producer_id: entry.getattr("producer_id")?.extract()?,
                        epoch: entry.getattr("producer_epoch")?.extract()?,
                        last_timestamp_ms: entry.getattr("last_timestamp_ms")?.extract()?,
                        batches,
                    });
                }
                (covered, entries)
            }
        };
        let mut table = Self::build(py, max_producers, idle_expiry_ms, window, None)?;
        for entry in entries {
            let mut batches = entry.batches;
            while batches.len() > table.window {
                batches.pop_front();
            }
            table.put(entry.producer_id, entry.epoch, entry.last_timestamp_ms, batches);
        }
        table.last_applied_offset = covered_offset as i128 - 1;
        table.restored_by_reference = by_reference;
        Ok((Py::new(py, table)?, covered_offset))
    }
}
