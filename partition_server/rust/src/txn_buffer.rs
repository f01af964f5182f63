//! partition_server/txn_buffer.py's TxnBuffer in Rust: the transaction buffer of one
//! partition (open transactions, the aborted-transaction index, remembered commits,
//! coordinator epochs per TC partition, max read position, bounds, counters, snapshots).
//!
//! The Python class stays the reference: this one takes the same arguments and gives the
//! same answers, built from the Python module's own types (OpenTxn, AbortedTxn,
//! MarkerPlan, TxnBufferState, TxnBufferMetrics, ControlType, TxnId), raises the same
//! errors (AtomlogError with the same reason, message and metadata; AssertionError where
//! the Python asserts; SnapshotCorrupt; struct.error where the Python's struct packing
//! refuses a value) and writes byte-identical snapshots. tests/test_native_txn_buffer.py
//! holds the two together on random operation sequences.
//!
//! The state is kept in Rust, in the Python's orders: the open table by insertion (its
//! first entry is the oldest open transaction), the aborted index and the remembered
//! commits by marker offset. Integers the Python keeps unbounded (offsets, epochs,
//! timestamps, producer fields as given) are kept as i128, so that what the Python accepts
//! here is accepted too and refused where it refuses (struct.error at snapshot time);
//! only ints beyond 128 bits raise OverflowError on the way in.

use pyo3::exceptions::{PyAssertionError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyTuple, PyType};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use crate::crc32c;

const OFFSET_MAX: i128 = i64::MAX as i128;
const COORDINATOR_EPOCH_MAX: i128 = u64::MAX as i128;
const PRODUCER_ID_MAX: i128 = i64::MAX as i128;

const LIMIT_OPEN: &str = "partition.max_open_transactions";
const LIMIT_ABORTED: &str = "partition.max_aborted_transactions";

const SNAPSHOT_MAGIC: &[u8; 4] = b"ALTB";
const SNAPSHOT_VERSION: u16 = 1;
const HEADER_SIZE: usize = 48; // <4sHHqqqIIII
const EPOCH_SIZE: usize = 12; // <IQ
const OPEN_SIZE: usize = 48; // <IQqIqqq
const ABORTED_SIZE: usize = 49; // <IQqIqqqB
const COMMITTED_SIZE: usize = 20; // <IQq
const TRAILER_SIZE: usize = 4;

// TxnBufferMetrics' fields, in their order.
const MARKERS_WRITTEN: usize = 0;
const MARKERS_NOOP: usize = 1;
const STALE_MARKERS: usize = 2;
const CONFLICTING_MARKERS: usize = 3;
const LATE_WRITES: usize = 4;
const EXHAUSTED: usize = 5;
const ABORTED_EVICTED: usize = 6;
const ANOMALIES: usize = 7;
const OPEN_DROPPED: usize = 8;
const COUNTERS: usize = 9;

/// The Python objects the answers are made of, looked up once (on first use).
struct Types {
    txn_id: PyObject,
    open_txn: PyObject,
    aborted_txn: PyObject,
    marker_plan: PyObject,
    write: PyObject,
    noop: PyObject,
    state: PyObject,
    metrics: PyObject,
    limits: PyObject,
    control_type: PyObject,
    commit: PyObject,
    abort: PyObject,
    snapshot_corrupt: PyObject,
    error: PyObject,
    mapping_proxy: PyObject,
    tuple_new: PyObject,
    struct_error: PyObject,
}

static TYPES: GILOnceCell<Types> = GILOnceCell::new();

fn types(py: Python<'_>) -> PyResult<&'static Types> {
    TYPES.get_or_try_init(py, || -> PyResult<Types> {
        let tb = py.import("partition_server.txn_buffer")?;
        let rb = py.import("partition_server.record_batch")?;
        let control = rb.getattr("ControlType")?;
        let action = tb.getattr("MarkerAction")?;
        Ok(Types {
            txn_id: rb.getattr("TxnId")?.unbind(),
            open_txn: tb.getattr("OpenTxn")?.unbind(),
            aborted_txn: tb.getattr("AbortedTxn")?.unbind(),
            marker_plan: tb.getattr("MarkerPlan")?.unbind(),
            write: action.getattr("WRITE")?.unbind(),
            noop: action.getattr("NOOP")?.unbind(),
            state: tb.getattr("TxnBufferState")?.unbind(),
            metrics: tb.getattr("TxnBufferMetrics")?.unbind(),
            limits: tb.getattr("TxnBufferLimits")?.unbind(),
            commit: control.getattr("COMMIT")?.unbind(),
            abort: control.getattr("ABORT")?.unbind(),
            control_type: control.unbind(),
            snapshot_corrupt: py.import("partition_server.snapshot_files")?
                .getattr("SnapshotCorrupt")?.unbind(),
            error: py.import("services.errors")?.getattr("AtomlogError")?.unbind(),
            mapping_proxy: py.import("types")?.getattr("MappingProxyType")?.unbind(),
            tuple_new: py.get_type::<PyTuple>().getattr("__new__")?.unbind(),
            struct_error: py.import("struct")?.getattr("error")?.unbind(),
        })
    })
}

// --- Errors, as txn_buffer.py raises them -------------------------------------------------

fn atomlog_error(py: Python<'_>, reason: &str, message: String, metadata: &[(&str, String)]) -> PyErr {
    match types(py) {
        Ok(types) => crate::new_atomlog_error(py, &types.error, reason, message, metadata),
        Err(error) => error,
    }
}

fn raise_with(py: Python<'_>, class: fn(&Types) -> &PyObject, message: String) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let error = class(types(py)?).call1(py, (message,))?;
        Ok(PyErr::from_value(error.into_bound(py)))
    };
    build().unwrap_or_else(|error| error)
}

fn corrupt(py: Python<'_>, message: String) -> PyErr {
    raise_with(py, |t| &t.snapshot_corrupt, message)
}

fn struct_error(py: Python<'_>, message: &str) -> PyErr {
    raise_with(py, |t| &t.struct_error, message.to_string())
}

/// `assert ..., value`: AssertionError(value) (the value as its only argument, a tuple
/// included).
fn assertion<T>(value: T) -> PyErr
where
    T: for<'py> IntoPyObject<'py> + Send + Sync + 'static,
{
    PyAssertionError::new_err((value,))
}

// --- Integers, as Python compares them ------------------------------------------------------

/// A Python int (any object with __index__) as i128: OverflowError only beyond 128 bits.
fn int(value: &Bound<'_, PyAny>) -> PyResult<i128> {
    match value.extract::<i64>() {
        Ok(value) => Ok(value as i128),
        Err(_) => value.extract::<i128>(),
    }
}

/// What `struct.pack` says of a value out of its field's range.
fn check_q(py: Python<'_>, value: i128) -> PyResult<i64> {
    if value < i64::MIN as i128 || value > i64::MAX as i128 {
        return Err(struct_error(py, "argument out of range"));
    }
    Ok(value as i64)
}

fn check_u32(py: Python<'_>, value: i128) -> PyResult<u32> {
    if value < 0 {
        return Err(struct_error(py, "argument out of range"));
    }
    if value > u32::MAX as i128 {
        return Err(struct_error(py, "'I' format requires 0 <= number <= 4294967295"));
    }
    Ok(value as u32)
}

fn check_u64(py: Python<'_>, value: i128) -> PyResult<u64> {
    if value < 0 || value > u64::MAX as i128 {
        return Err(struct_error(py, "argument out of range"));
    }
    Ok(value as u64)
}

// --- Transaction ids --------------------------------------------------------------------------

/// txn_key: TC partition << 64 | sequence.
type Key = u128;

fn key_of(tc: u32, sequence: u64) -> Key {
    (tc as u128) << 64 | sequence as u128
}

fn tc_of(key: Key) -> u32 {
    (key >> 64) as u32
}

fn sequence_of(key: Key) -> u64 {
    key as u64
}

fn name(key: Key) -> String {
    format!("({}, {})", tc_of(key), sequence_of(key))
}

/// The two fields of a transaction id (`tc, sequence = txn`).
fn unpack<'py>(txn: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let fields = match txn.downcast::<PyTuple>() {
        Ok(fields) => fields,
        Err(_) => return Err(PyTypeError::new_err("a transaction id is a (tc_partition, sequence) tuple")),
    };
    match fields.len() {
        2 => Ok((fields.get_item(0)?, fields.get_item(1)?)),
        n if n > 2 => Err(PyValueError::new_err("too many values to unpack (expected 2)")),
        n => Err(PyValueError::new_err(format!("not enough values to unpack (expected 2, got {n})"))),
    }
}

fn is_int(value: &Bound<'_, PyAny>) -> bool {
    value.is_instance_of::<PyInt>()
}

/// The key of a transaction id to look up: None for ints out of the id's range (no
/// transaction of the tables has such an id).
fn lookup_key(txn: &Bound<'_, PyAny>) -> PyResult<Option<Key>> {
    let (tc, sequence) = unpack(txn)?;
    match (tc.extract::<u32>(), sequence.extract::<u64>()) {
        (Ok(tc), Ok(sequence)) => Ok(Some(key_of(tc, sequence))),
        _ if is_int(&tc) && is_int(&sequence) => Ok(None),
        _ => Err(PyTypeError::new_err("a transaction id's fields are ints")),
    }
}

/// _validate_txn: the key of a valid id, else INVALID_ARGUMENT.
fn validate_txn(py: Python<'_>, txn: &Bound<'_, PyAny>) -> PyResult<Key> {
    let (tc, sequence) = unpack(txn)?;
    if let (Ok(tc), Ok(sequence)) = (tc.extract::<u32>(), sequence.extract::<u64>()) {
        if tc != 0 || sequence != 0 {
            return Ok(key_of(tc, sequence));
        }
    } else if !(is_int(&tc) && is_int(&sequence)) {
        return Err(PyTypeError::new_err("a transaction id's fields are ints"));
    }
    Err(atomlog_error(
        py,
        "INVALID_ARGUMENT",
        format!("transaction id ({}, {}) is not a valid transaction", tc.str()?, sequence.str()?),
        &[("field", "txn_id".to_string())],
    ))
}

/// _validate_producer.
fn validate_producer(py: Python<'_>, producer_id: &Bound<'_, PyAny>, producer_epoch: &Bound<'_, PyAny>) -> PyResult<()> {
    let id = int(producer_id)?;
    if !(0..=PRODUCER_ID_MAX).contains(&id) {
        return Err(atomlog_error(
            py,
            "INVALID_ARGUMENT",
            format!("producer_id {} is out of range", producer_id.str()?),
            &[("field", "producer_id".to_string())],
        ));
    }
    let epoch = int(producer_epoch)?;
    if !(0..=u32::MAX as i128).contains(&epoch) {
        return Err(atomlog_error(
            py,
            "INVALID_ARGUMENT",
            format!("producer_epoch {} is out of range", producer_epoch.str()?),
            &[("field", "producer_epoch".to_string())],
        ));
    }
    Ok(())
}

fn past(commit: bool) -> &'static str {
    if commit {
        "committed"
    } else {
        "aborted"
    }
}

// --- The buffer -------------------------------------------------------------------------------

/// An open transaction (txn_buffer._Open).
#[derive(Clone, Copy, Debug)]
struct Open {
    key: Key,
    producer_id: i128,
    producer_epoch: i128,
    first_offset: i64,
    last_offset: i64,
    first_timestamp_ms: i128,
}

/// A row of the aborted index (its snapshot row's fields, checked when it was made).
#[derive(Clone, Copy, Debug)]
struct Aborted {
    key: Key,
    producer_id: i64,
    producer_epoch: u32,
    first_offset: i64,
    marker_offset: i64,
    last_stable_offset: i64,
    indexed: bool,
}

/// partition_server.txn_buffer.TxnBuffer in Rust (see the module doc).
#[pyclass(module = "partition_server._native")]
pub struct TxnBuffer {
    limits: PyObject,
    max_open: i128,
    max_aborted: i128,
    max_commits: i128,
    // The open table in insertion order: a sequence number per insertion, and the lookup.
    open: BTreeMap<u64, Open>,
    open_lookup: HashMap<Key, u64>,
    open_next: u64,
    // The aborted index by marker offset, and the lookup (txn -> its entry's marker).
    aborted: VecDeque<Aborted>,
    aborted_lookup: HashMap<Key, i64>,
    // The remembered commits by marker offset; a row is live while the lookup gives its
    // marker offset (commits forgotten out of order leave dead rows, as in the Python).
    committed: VecDeque<(Key, i64)>,
    committed_lookup: HashMap<Key, i64>,
    committed_dead: usize,
    // The highest written marker epoch per TC partition, and the same as a Python dict
    // (in the Python's insertion order) that coordinator_epochs() shows read-only.
    epochs: HashMap<u32, i128>,
    epochs_dict: Py<PyDict>,
    epochs_view: PyObject,
    // Ended, marker not durable yet: (marker_offset, first_offset), by marker offset.
    unreplicated: Vec<(i64, i64)>,
    log_start_offset: i128,
    aborted_evicted_below: i128,
    last_applied_offset: i64,
    changes: u64,
    counters: [u64; COUNTERS],
    // MarkerPlans made (frozen values): WRITE by producer, and the plain NOOP.
    write_plans: HashMap<(i128, i128), PyObject>,
    noop_plan: Option<PyObject>,
}

fn limit_of(limits: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
    int(&limits.getattr(name)?)
}

impl TxnBuffer {
    fn build(py: Python<'_>, limits: Option<Bound<'_, PyAny>>) -> PyResult<TxnBuffer> {
        let t = types(py)?;
        let limits = match limits {
            Some(limits) if limits.is_truthy()? => limits,
            _ => t.limits.bind(py).call0()?,
        };
        let epochs_dict = PyDict::new(py);
        let epochs_view = t.mapping_proxy.call1(py, (epochs_dict.clone(),))?;
        let mut buffer = TxnBuffer {
            limits: limits.clone().unbind(),
            max_open: 0,
            max_aborted: 0,
            max_commits: 0,
            open: BTreeMap::new(),
            open_lookup: HashMap::new(),
            open_next: 0,
            aborted: VecDeque::new(),
            aborted_lookup: HashMap::new(),
            committed: VecDeque::new(),
            committed_lookup: HashMap::new(),
            committed_dead: 0,
            epochs: HashMap::new(),
            epochs_dict: epochs_dict.unbind(),
            epochs_view,
            unreplicated: Vec::new(),
            log_start_offset: 0,
            aborted_evicted_below: 0,
            last_applied_offset: -1,
            changes: 0,
            counters: [0; COUNTERS],
            write_plans: HashMap::new(),
            noop_plan: None,
        };
        buffer.read_limits(&limits)?;
        Ok(buffer)
    }

    fn read_limits(&mut self, limits: &Bound<'_, PyAny>) -> PyResult<()> {
        self.max_open = limit_of(limits, "max_open_transactions")?;
        self.max_aborted = limit_of(limits, "max_aborted_transactions")?;
        self.max_commits = limit_of(limits, "max_remembered_commits")?;
        Ok(())
    }

    fn open_get(&self, key: Key) -> Option<&Open> {
        match self.open_lookup.get(&key) {
            Some(slot) => self.open.get(slot),
            None => None,
        }
    }

    fn open_pop(&mut self, key: Key) -> Option<Open> {
        match self.open_lookup.remove(&key) {
            Some(slot) => self.open.remove(&slot),
            None => None,
        }
    }

    fn oldest(&self) -> Option<&Open> {
        self.open.values().next()
    }

    /// (committed?, marker offset) of a transaction ended here and remembered.
    fn ended_key(&self, key: Key) -> Option<(bool, i64)> {
        if let Some(marker) = self.aborted_lookup.get(&key) {
            return Some((false, *marker));
        }
        self.committed_lookup.get(&key).map(|marker| (true, *marker))
    }

    fn aborted_index_start(&self) -> i128 {
        self.log_start_offset.max(self.aborted_evicted_below)
    }

    fn advance(&mut self, first_offset: i128, last_offset: i128) -> PyResult<()> {
        if !(0 <= first_offset && first_offset <= last_offset && last_offset <= OFFSET_MAX) {
            return Err(assertion((first_offset, last_offset)));
        }
        if first_offset <= self.last_applied_offset as i128 {
            return Err(assertion((first_offset, self.last_applied_offset)));
        }
        self.last_applied_offset = last_offset as i64;
        Ok(())
    }

    fn record_data(&mut self, key: Key, producer_id: i128, producer_epoch: i128, first_offset: i64,
                   last_offset: i64, timestamp_ms: i128) {
        self.changes += 1;
        if let Some(slot) = self.open_lookup.get(&key) {
            if let Some(entry) = self.open.get_mut(slot) {
                entry.last_offset = last_offset;
            }
            return;
        }
        let slot = self.open_next;
        self.open_next += 1;
        self.open.insert(slot, Open {
            key,
            producer_id,
            producer_epoch,
            first_offset,
            last_offset,
            first_timestamp_ms: timestamp_ms,
        });
        self.open_lookup.insert(key, slot);
    }

    #[allow(clippy::too_many_arguments)]
    fn end(&mut self, py: Python<'_>, key: Key, commit: bool, coordinator_epoch: i128,
           marker_offset: i64, producer_id: i128, producer_epoch: i128) -> PyResult<()> {
        self.changes += 1;
        let tc = tc_of(key);
        let raise = match self.epochs.get(&tc) {
            None => true,
            Some(current) => coordinator_epoch > *current,
        };
        if raise {
            self.epochs.insert(tc, coordinator_epoch);
            self.epochs_dict.bind(py).set_item(tc, coordinator_epoch)?;
        }
        let entry = self.open_pop(key);
        let first_offset = match entry {
            Some(entry) => {
                self.unreplicated.push((marker_offset, entry.first_offset));
                entry.first_offset
            }
            None => marker_offset, // data retained away
        };
        self.forget_commit(key);
        if !self.aborted_lookup.is_empty() {
            self.unindex_aborted(key);
        }
        if commit {
            self.committed.push_back((key, marker_offset));
            self.committed_lookup.insert(key, marker_offset);
        } else {
            let last_stable_offset = match self.oldest() {
                Some(oldest) => oldest.first_offset as i128,
                None => marker_offset as i128 + 1,
            };
            // _aborted_row's struct.pack, field by field.
            let producer_id = check_q(py, producer_id)?;
            let producer_epoch = check_u32(py, producer_epoch)?;
            let last_stable_offset = check_q(py, last_stable_offset)?;
            self.aborted.push_back(Aborted {
                key,
                producer_id,
                producer_epoch,
                first_offset,
                marker_offset,
                last_stable_offset,
                indexed: true,
            });
            self.aborted_lookup.insert(key, marker_offset);
        }
        self.enforce_bounds();
        Ok(())
    }

    fn enforce_bounds(&mut self) {
        while self.committed_lookup.len() as i128 > self.max_commits {
            self.drop_oldest_commit();
        }
        self.compact_commits();
        while self.aborted.len() as i128 > self.max_aborted {
            let evicted = match self.drop_oldest_aborted() {
                Some(marker) => marker,
                None => break,
            };
            self.aborted_evicted_below = self.aborted_evicted_below.max(evicted as i128 + 1);
            self.counters[ABORTED_EVICTED] += 1;
        }
    }

    fn forget_commit(&mut self, key: Key) {
        if self.committed_lookup.remove(&key).is_some() {
            self.committed_dead += 1;
        }
    }

    fn drop_oldest_commit(&mut self) {
        if let Some((key, marker)) = self.committed.pop_front() {
            if self.committed_lookup.get(&key) == Some(&marker) {
                self.committed_lookup.remove(&key);
            } else {
                self.committed_dead -= 1;
            }
        }
    }

    /// Drop the dead rows once they are most of them (as the Python's _compact_commits).
    fn compact_commits(&mut self) {
        if self.committed_dead > self.committed_lookup.len() + 64 {
            let lookup = &self.committed_lookup;
            self.committed.retain(|(key, marker)| lookup.get(key) == Some(marker));
            self.committed_dead = 0;
        }
    }

    fn live_commits(&self) -> impl Iterator<Item = &(Key, i64)> {
        let lookup = &self.committed_lookup;
        let all = self.committed_dead == 0;
        self.committed.iter().filter(move |(key, marker)| all || lookup.get(key) == Some(marker))
    }

    fn drop_oldest_aborted(&mut self) -> Option<i64> {
        let entry = self.aborted.pop_front()?;
        if self.aborted_lookup.get(&entry.key) == Some(&entry.marker_offset) {
            self.aborted_lookup.remove(&entry.key);
        }
        Some(entry.marker_offset)
    }

    fn unindex_aborted(&mut self, key: Key) {
        if let Some(marker) = self.aborted_lookup.remove(&key) {
            let index = self.aborted.partition_point(|entry| entry.marker_offset < marker);
            if let Some(entry) = self.aborted.get_mut(index) {
                debug_assert_eq!(entry.marker_offset, marker);
                entry.indexed = false;
            }
        }
    }

    // -- Python values --

    fn txn_object(&self, py: Python<'_>, t: &Types, key: Key) -> PyResult<PyObject> {
        t.tuple_new.call1(py, (t.txn_id.clone_ref(py), (tc_of(key), sequence_of(key))))
    }

    fn open_object(&self, py: Python<'_>, t: &Types, entry: &Open) -> PyResult<PyObject> {
        let fields = (self.txn_object(py, t, entry.key)?, entry.producer_id, entry.producer_epoch,
                      entry.first_offset, entry.last_offset, entry.first_timestamp_ms);
        t.tuple_new.call1(py, (t.open_txn.clone_ref(py), fields))
    }

    fn aborted_object(&self, py: Python<'_>, t: &Types, entry: &Aborted) -> PyResult<PyObject> {
        let fields = (self.txn_object(py, t, entry.key)?, entry.producer_id, entry.producer_epoch,
                      entry.first_offset, entry.marker_offset, entry.last_stable_offset);
        t.tuple_new.call1(py, (t.aborted_txn.clone_ref(py), fields))
    }

    fn write_plan(&mut self, py: Python<'_>, producer_id: i128, producer_epoch: i128) -> PyResult<PyObject> {
        if let Some(plan) = self.write_plans.get(&(producer_id, producer_epoch)) {
            return Ok(plan.clone_ref(py));
        }
        let t = types(py)?;
        let plan = t.marker_plan.call1(py, (t.write.clone_ref(py), false, -1, producer_id, producer_epoch))?;
        if self.write_plans.len() >= 1024 {
            self.write_plans.clear();
        }
        self.write_plans.insert((producer_id, producer_epoch), plan.clone_ref(py));
        Ok(plan)
    }

    fn describe_list(&self, py: Python<'_>) -> PyResult<Vec<PyObject>> {
        let t = types(py)?;
        self.open.values().map(|entry| self.open_object(py, t, entry)).collect()
    }

    fn sorted_epochs(&self) -> Vec<(u32, i128)> {
        let mut epochs: Vec<(u32, i128)> = self.epochs.iter().map(|(tc, epoch)| (*tc, *epoch)).collect();
        epochs.sort_unstable();
        epochs
    }

    /// The key of a transaction id given to on_data/on_marker/apply_batch (the Python
    /// takes any; ids out of range cannot be kept here).
    fn kept_key(txn: &Bound<'_, PyAny>) -> PyResult<Key> {
        match lookup_key(txn)? {
            Some(key) => Ok(key),
            None => Err(PyValueError::new_err(format!(
                "transaction id {} is out of range (tc_partition < 2**32, sequence < 2**64)",
                txn.repr()?
            ))),
        }
    }

    fn is_commit(py: Python<'_>, t: &Types, decision: &Bound<'_, PyAny>) -> PyResult<bool> {
        if decision.get_type().as_ptr() == t.control_type.as_ptr() {
            return Ok(decision.as_ptr() == t.commit.as_ptr());
        }
        let decision = t.control_type.call1(py, (decision,))?;
        Ok(decision.as_ptr() == t.commit.as_ptr())
    }
}

fn put_q(out: &mut Vec<u8>, py: Python<'_>, value: i128) -> PyResult<()> {
    out.extend_from_slice(&check_q(py, value)?.to_le_bytes());
    Ok(())
}

fn put_u32(out: &mut Vec<u8>, py: Python<'_>, value: i128) -> PyResult<()> {
    out.extend_from_slice(&check_u32(py, value)?.to_le_bytes());
    Ok(())
}

fn put_u64(out: &mut Vec<u8>, py: Python<'_>, value: i128) -> PyResult<()> {
    out.extend_from_slice(&check_u64(py, value)?.to_le_bytes());
    Ok(())
}

fn le_u16(data: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([data[at], data[at + 1]])
}

fn le_u32(data: &[u8], at: usize) -> u32 {
    let mut bytes = [0u8; 4];
    bytes.copy_from_slice(&data[at..at + 4]);
    u32::from_le_bytes(bytes)
}

fn le_u64(data: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&data[at..at + 8]);
    u64::from_le_bytes(bytes)
}

fn le_i64(data: &[u8], at: usize) -> i64 {
    le_u64(data, at) as i64
}

/// A decoded snapshot (decode_snapshot's covered offset and state, as rows).
struct Decoded {
    covered: i64,
    log_start: i64,
    evicted_below: i64,
    epochs: Vec<(u32, u64)>,
    open: Vec<(Key, i64, u32, i64, i64, i64)>,
    aborted: Vec<(Key, i64, u32, i64, i64, i64, u8)>,
    committed: Vec<(Key, i64)>,
}

/// decode_snapshot (with unseal and _state_problem): the same checks in the same order,
/// the same SnapshotCorrupt messages.
fn decode(py: Python<'_>, data: &[u8]) -> PyResult<Decoded> {
    if data.len() < HEADER_SIZE + TRAILER_SIZE {
        return Err(corrupt(py, format!("snapshot is {} bytes, shorter than its header", data.len())));
    }
    if &data[..4] != SNAPSHOT_MAGIC {
        let magic = PyBytes::new(py, &data[..4]).repr()?;
        return Err(corrupt(py, format!("not a transaction-buffer snapshot (magic {magic})")));
    }
    let body = &data[..data.len() - TRAILER_SIZE];
    let stored = le_u32(data, body.len());
    let computed = crc32c::value(body, 0);
    if computed != stored {
        return Err(corrupt(py, format!("CRC32C mismatch: stored {stored:#010x}, computed {computed:#010x}")));
    }
    let version = le_u16(data, 4);
    if version != SNAPSHOT_VERSION {
        return Err(corrupt(py, format!("unsupported snapshot version {version} (this build reads {SNAPSHOT_VERSION})")));
    }
    let reserved = le_u16(data, 6);
    if reserved != 0 {
        return Err(corrupt(py, format!("reserved header field is {reserved}, not 0")));
    }
    let covered = le_i64(data, 8);
    let log_start = le_i64(data, 16);
    let evicted_below = le_i64(data, 24);
    let counts = [le_u32(data, 32) as u64, le_u32(data, 36) as u64, le_u32(data, 40) as u64, le_u32(data, 44) as u64];
    let sizes = [EPOCH_SIZE as u64, OPEN_SIZE as u64, ABORTED_SIZE as u64, COMMITTED_SIZE as u64];
    let expected: u64 = HEADER_SIZE as u64 + counts.iter().zip(sizes.iter()).map(|(c, s)| c * s).sum::<u64>();
    if expected != body.len() as u64 {
        return Err(corrupt(py, format!("snapshot body is {} bytes; its counts say {expected}", body.len())));
    }
    let mut at = HEADER_SIZE;
    let mut decoded = Decoded {
        covered,
        log_start,
        evicted_below,
        epochs: Vec::with_capacity(counts[0] as usize),
        open: Vec::with_capacity(counts[1] as usize),
        aborted: Vec::with_capacity(counts[2] as usize),
        committed: Vec::with_capacity(counts[3] as usize),
    };
    for _ in 0..counts[0] {
        decoded.epochs.push((le_u32(body, at), le_u64(body, at + 4)));
        at += EPOCH_SIZE;
    }
    for _ in 0..counts[1] {
        decoded.open.push((key_of(le_u32(body, at), le_u64(body, at + 4)), le_i64(body, at + 12),
                           le_u32(body, at + 20), le_i64(body, at + 24), le_i64(body, at + 32),
                           le_i64(body, at + 40)));
        at += OPEN_SIZE;
    }
    for _ in 0..counts[2] {
        decoded.aborted.push((key_of(le_u32(body, at), le_u64(body, at + 4)), le_i64(body, at + 12),
                              le_u32(body, at + 20), le_i64(body, at + 24), le_i64(body, at + 32),
                              le_i64(body, at + 40), body[at + 48]));
        at += ABORTED_SIZE;
    }
    for _ in 0..counts[3] {
        decoded.committed.push((key_of(le_u32(body, at), le_u64(body, at + 4)), le_i64(body, at + 12)));
        at += COMMITTED_SIZE;
    }
    if let Some(problem) = state_problem(&decoded) {
        return Err(corrupt(py, problem));
    }
    Ok(decoded)
}

/// _state_problem.
fn state_problem(d: &Decoded) -> Option<String> {
    if !(0 <= d.log_start && d.log_start <= d.covered) || d.evicted_below < 0 {
        return Some("log start, covered offset or eviction bound out of range".to_string());
    }
    if d.epochs.windows(2).any(|pair| pair[0].0 >= pair[1].0) {
        return Some("epochs are not by unique ascending TC partition".to_string());
    }
    let txns: Vec<Key> = d.open.iter().map(|row| row.0)
        .chain(d.committed.iter().map(|row| row.0))
        .chain(d.aborted.iter().filter(|row| row.6 != 0).map(|row| row.0))
        .collect();
    let unique: HashSet<Key> = txns.iter().copied().collect();
    if unique.len() != txns.len() || unique.contains(&0) {
        return Some("a transaction id is invalid or in more than one table".to_string());
    }
    if d.aborted.iter().any(|row| row.6 > 1) {
        return Some("an aborted entry has an indexed flag other than 0 or 1".to_string());
    }
    let mut previous = -1i64;
    for row in &d.open {
        if !(previous < row.3 && row.3 <= row.4 && row.4 < d.covered) {
            return Some(format!("open transaction {} has offsets out of order", name(row.0)));
        }
        previous = row.3;
    }
    let aborted: Vec<i64> = d.aborted.iter().map(|row| row.4).collect();
    let committed: Vec<i64> = d.committed.iter().map(|row| row.1).collect();
    for (what, markers) in [("aborted", &aborted), ("committed", &committed)] {
        let ascending = markers.windows(2).all(|pair| pair[0] < pair[1]);
        let low = markers.first().map_or(false, |first| *first < 0);
        let high = markers.last().map_or(false, |last| *last >= d.covered);
        if !ascending || low || high {
            return Some(format!("{what} markers are not unique, ascending and below the covered offset"));
        }
    }
    for row in &d.aborted {
        let (first, marker, lso, producer_id) = (row.3 as i128, row.4 as i128, row.5 as i128, row.1 as i128);
        if !((0..=marker).contains(&first) && (0..=marker + 1).contains(&lso)
             && (0..=PRODUCER_ID_MAX).contains(&producer_id)) {
            return Some(format!("aborted transaction {} has fields out of range", name(row.0)));
        }
    }
    None
}

#[pymethods]
impl TxnBuffer {
    #[new]
    #[pyo3(signature = (limits = None))]
    fn new(py: Python<'_>, limits: Option<Bound<'_, PyAny>>) -> PyResult<Self> {
        TxnBuffer::build(py, limits)
    }

    // -- observability --

    #[getter]
    fn limits(&self, py: Python<'_>) -> PyObject {
        self.limits.clone_ref(py)
    }

    #[setter]
    fn set_limits(&mut self, limits: Bound<'_, PyAny>) -> PyResult<()> {
        self.read_limits(&limits)?;
        self.limits = limits.unbind();
        Ok(())
    }

    #[getter]
    fn changes(&self) -> u64 {
        self.changes
    }

    #[getter]
    fn metrics(&self, py: Python<'_>) -> PyResult<PyObject> {
        let c = &self.counters;
        types(py)?.metrics.call1(py, (c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8]))
    }

    #[getter]
    fn last_applied_offset(&self) -> i64 {
        self.last_applied_offset
    }

    #[getter]
    fn log_start_offset(&self) -> i128 {
        self.log_start_offset
    }

    #[getter]
    fn open_count(&self) -> usize {
        self.open.len()
    }

    #[getter]
    fn aborted_count(&self) -> usize {
        self.aborted.len()
    }

    #[getter(aborted_index_start)]
    fn get_aborted_index_start(&self) -> i128 {
        self.aborted_index_start()
    }

    fn oldest_open(&self, py: Python<'_>) -> PyResult<Option<PyObject>> {
        match self.oldest() {
            Some(entry) => Ok(Some(self.open_object(py, types(py)?, entry)?)),
            None => Ok(None),
        }
    }

    fn describe<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.describe_list(py)?)
    }

    fn count_older_than(&self, now_ms: &Bound<'_, PyAny>, age_ms: &Bound<'_, PyAny>) -> PyResult<usize> {
        let (now_ms, age_ms) = (int(now_ms)?, int(age_ms)?);
        let mut count = 0;
        for entry in self.open.values() {
            if now_ms.saturating_sub(entry.first_timestamp_ms) <= age_ms {
                break;
            }
            count += 1;
        }
        Ok(count)
    }

    pub(crate) fn coordinator_epochs(&self, py: Python<'_>) -> PyObject {
        self.epochs_view.clone_ref(py)
    }

    pub(crate) fn open_transaction(&self, py: Python<'_>, txn: &Bound<'_, PyAny>) -> PyResult<Option<PyObject>> {
        let entry = match lookup_key(txn)? {
            Some(key) => self.open_get(key),
            None => None,
        };
        match entry {
            Some(entry) => Ok(Some(self.open_object(py, types(py)?, entry)?)),
            None => Ok(None),
        }
    }

    pub(crate) fn ended(&self, py: Python<'_>, txn: &Bound<'_, PyAny>) -> PyResult<Option<(PyObject, i64)>> {
        let ended = match lookup_key(txn)? {
            Some(key) => self.ended_key(key),
            None => None,
        };
        match ended {
            Some((commit, marker)) => {
                let t = types(py)?;
                let decision = if commit { &t.commit } else { &t.abort };
                Ok(Some((decision.clone_ref(py), marker)))
            }
            None => Ok(None),
        }
    }

    fn state(&self, py: Python<'_>) -> PyResult<PyObject> {
        let t = types(py)?;
        let epochs = PyTuple::new(py, self.sorted_epochs())?;
        let open = PyTuple::new(py, self.describe_list(py)?)?;
        let aborted: Vec<(PyObject, bool)> = self.aborted.iter()
            .map(|entry| Ok((self.aborted_object(py, t, entry)?, entry.indexed)))
            .collect::<PyResult<_>>()?;
        let committed: Vec<(PyObject, i64)> = self.live_commits()
            .map(|(key, marker)| Ok((self.txn_object(py, t, *key)?, *marker)))
            .collect::<PyResult<_>>()?;
        let fields = (self.log_start_offset, self.aborted_evicted_below, epochs, open,
                      PyTuple::new(py, aborted)?, PyTuple::new(py, committed)?);
        t.tuple_new.call1(py, (t.state.clone_ref(py), fields))
    }

    // -- reads --

    fn max_read_position(&self, high_watermark: &Bound<'_, PyAny>) -> PyResult<i128> {
        let high_watermark = int(high_watermark)?;
        let mut position = high_watermark;
        if let Some(oldest) = self.oldest() {
            position = position.min(oldest.first_offset as i128);
        }
        for (marker, first) in &self.unreplicated {
            if *marker as i128 >= high_watermark {
                position = position.min(*first as i128);
            }
        }
        Ok(position)
    }

    fn aborted_in<'py>(&self, py: Python<'py>, start: &Bound<'py, PyAny>, end: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let (start_value, end_value) = (int(start)?, int(end)?);
        if !(0 <= start_value && start_value <= end_value) {
            return Err(assertion((start.clone().unbind(), end.clone().unbind())));
        }
        let index_start = self.aborted_index_start();
        if start_value < index_start {
            return Err(atomlog_error(
                py,
                "OFFSET_OUT_OF_RANGE",
                format!("read_committed from offset {start_value}: the aborted-transaction index of \
                         this partition starts at {index_start} ({LIMIT_ABORTED}={} entries, or \
                         retention)", self.max_aborted),
                &[("aborted_index_start", index_start.to_string()), ("limit", LIMIT_ABORTED.to_string())],
            ));
        }
        let t = types(py)?;
        let result = PyList::empty(py);
        let first = self.aborted.partition_point(|entry| entry.marker_offset as i128 <= start_value);
        for entry in self.aborted.iter().skip(first) {
            if entry.marker_offset as i128 <= end_value {
                result.append(self.aborted_object(py, t, entry)?)?;
                continue;
            }
            if (entry.first_offset as i128) < end_value {
                result.append(self.aborted_object(py, t, entry)?)?;
            }
            if entry.last_stable_offset as i128 >= end_value {
                break;
            }
        }
        Ok(result)
    }

    // -- decisions --

    pub(crate) fn check_write(&mut self, py: Python<'_>, txn: &Bound<'_, PyAny>, producer_id: &Bound<'_, PyAny>,
                   producer_epoch: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = validate_txn(py, txn)?;
        validate_producer(py, producer_id, producer_epoch)?;
        if self.open_lookup.contains_key(&key) {
            return Ok(());
        }
        if let Some((commit, marker)) = self.ended_key(key) {
            self.counters[LATE_WRITES] += 1;
            return Err(atomlog_error(
                py,
                "TRANSACTION_NOT_OPEN",
                format!("transaction {} was {} on this partition (marker at offset {marker}); it \
                         takes no more writes", name(key), past(commit)),
                &[("txn_id", name(key)), ("marker_offset", marker.to_string())],
            ));
        }
        if self.open.len() as i128 >= self.max_open {
            self.counters[EXHAUSTED] += 1;
            return Err(atomlog_error(
                py,
                "RESOURCE_EXHAUSTED",
                format!("partition has {} open transactions, the limit {LIMIT_OPEN}={}: \
                         transaction {} cannot start here until one ends",
                        self.open.len(), self.max_open, name(key)),
                &[("limit", LIMIT_OPEN.to_string()), ("max_open_transactions", self.max_open.to_string())],
            ));
        }
        Ok(())
    }

    pub(crate) fn check_marker(&mut self, py: Python<'_>, txn: &Bound<'_, PyAny>, decision: &Bound<'_, PyAny>,
                    coordinator_epoch: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let t = types(py)?;
        let epoch = int(coordinator_epoch);
        // The usual case first: open here, a ControlType, the epoch current.
        if let (Some(key), Ok(epoch)) = (lookup_key(txn)?, &epoch) {
            if let Some(entry) = self.open_get(key) {
                let current = self.epochs.get(&tc_of(key)).copied().unwrap_or(0);
                if decision.get_type().as_ptr() == t.control_type.as_ptr()
                    && current <= *epoch && *epoch <= COORDINATOR_EPOCH_MAX {
                    let (producer_id, producer_epoch) = (entry.producer_id, entry.producer_epoch);
                    return self.write_plan(py, producer_id, producer_epoch);
                }
            }
        }
        let key = validate_txn(py, txn)?;
        let commit = TxnBuffer::is_commit(py, t, decision)?;
        let epoch = epoch?;
        if !(0..=COORDINATOR_EPOCH_MAX).contains(&epoch) {
            return Err(assertion(coordinator_epoch.clone().unbind()));
        }
        let tc = tc_of(key);
        let current = self.epochs.get(&tc).copied().unwrap_or(0);
        if epoch < current {
            self.counters[STALE_MARKERS] += 1;
            return Err(atomlog_error(
                py,
                "STALE_COORDINATOR_EPOCH",
                format!("marker for {} has coordinator epoch {epoch}; this partition wrote a marker \
                         of TC partition {tc} with epoch {current}", name(key)),
                &[("tc_partition", tc.to_string()), ("coordinator_epoch", epoch.to_string()),
                  ("current_epoch", current.to_string())],
            ));
        }
        if let Some(entry) = self.open_get(key) {
            let (producer_id, producer_epoch) = (entry.producer_id, entry.producer_epoch);
            return self.write_plan(py, producer_id, producer_epoch);
        }
        let ended = self.ended_key(key);
        if let Some((ended_commit, marker)) = ended {
            if ended_commit != commit {
                self.counters[CONFLICTING_MARKERS] += 1;
                let reason = if ended_commit { "TRANSACTION_ALREADY_COMMITTED" } else { "TRANSACTION_ABORTED" };
                return Err(atomlog_error(
                    py,
                    reason,
                    format!("{} marker for {}, which this partition {} (marker at offset {marker})",
                            if commit { "COMMIT" } else { "ABORT" }, name(key), past(ended_commit)),
                    &[("txn_id", name(key)), ("marker_offset", marker.to_string())],
                ));
            }
        }
        self.counters[MARKERS_NOOP] += 1;
        match ended {
            None => {
                if let Some(plan) = &self.noop_plan {
                    return Ok(plan.clone_ref(py));
                }
                let plan = t.marker_plan.call1(py, (t.noop.clone_ref(py),))?;
                self.noop_plan = Some(plan.clone_ref(py));
                Ok(plan)
            }
            Some((_, marker)) => t.marker_plan.call1(py, (t.noop.clone_ref(py), true, marker)),
        }
    }

    // -- transitions (live) --

    pub(crate) fn on_data(&mut self, txn: &Bound<'_, PyAny>, producer_id: &Bound<'_, PyAny>,
               producer_epoch: &Bound<'_, PyAny>, first_offset: &Bound<'_, PyAny>,
               last_offset: &Bound<'_, PyAny>, timestamp_ms: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = TxnBuffer::kept_key(txn)?;
        let (producer_id, producer_epoch) = (int(producer_id)?, int(producer_epoch)?);
        let (first, last, timestamp_ms) = (int(first_offset)?, int(last_offset)?, int(timestamp_ms)?);
        if !self.open_lookup.contains_key(&key) && self.ended_key(key).is_some() {
            return Err(assertion(txn.clone().unbind()));
        }
        self.advance(first, last)?;
        self.record_data(key, producer_id, producer_epoch, first as i64, last as i64, timestamp_ms);
        Ok(())
    }

    pub(crate) fn on_marker(&mut self, py: Python<'_>, txn: &Bound<'_, PyAny>, decision: &Bound<'_, PyAny>,
                 coordinator_epoch: &Bound<'_, PyAny>, marker_offset: &Bound<'_, PyAny>) -> PyResult<()> {
        let entry = match lookup_key(txn)? {
            Some(key) => self.open_get(key).copied(),
            None => None,
        };
        let entry = match entry {
            Some(entry) => entry,
            None => return Err(assertion(txn.clone().unbind())),
        };
        let epoch = int(coordinator_epoch)?;
        if epoch < self.epochs.get(&tc_of(entry.key)).copied().unwrap_or(0) {
            return Err(assertion(coordinator_epoch.clone().unbind()));
        }
        let marker = int(marker_offset)?;
        self.advance(marker, marker)?;
        self.counters[MARKERS_WRITTEN] += 1;
        let commit = TxnBuffer::is_commit(py, types(py)?, decision)?;
        self.end(py, entry.key, commit, epoch, marker as i64, entry.producer_id, entry.producer_epoch)
    }

    fn on_durable(&mut self, high_watermark: &Bound<'_, PyAny>) -> PyResult<()> {
        let high_watermark = int(high_watermark)?;
        if let Some((marker, _)) = self.unreplicated.first() {
            if (*marker as i128) < high_watermark {
                self.unreplicated.retain(|(marker, _)| *marker as i128 >= high_watermark);
            }
        }
        Ok(())
    }

    fn forget_below(&mut self, log_start_offset: &Bound<'_, PyAny>) -> PyResult<()> {
        let log_start = int(log_start_offset)?;
        if log_start <= self.log_start_offset {
            return Ok(());
        }
        self.log_start_offset = log_start;
        self.changes += 1;
        while let Some(entry) = self.aborted.front() {
            if entry.marker_offset as i128 >= log_start {
                break;
            }
            self.drop_oldest_aborted();
        }
        while let Some((_, marker)) = self.committed.front() {
            if *marker as i128 >= log_start {
                break;
            }
            self.drop_oldest_commit();
        }
        self.compact_commits();
        let gone: Vec<(u64, Key)> = self.open.iter()
            .filter(|(_, entry)| (entry.last_offset as i128) < log_start)
            .map(|(slot, entry)| (*slot, entry.key))
            .collect();
        for (slot, key) in &gone {
            self.open.remove(slot);
            self.open_lookup.remove(key);
        }
        self.counters[OPEN_DROPPED] += gone.len() as u64;
        Ok(())
    }

    // -- replay --

    #[pyo3(signature = (header, marker = None))]
    fn apply_batch(&mut self, py: Python<'_>, header: &Bound<'_, PyAny>, marker: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let fields = header.downcast::<PyTuple>()?;
        if fields.len() != 15 {
            return Err(PyValueError::new_err("a BatchHeader has 15 fields"));
        }
        let base = int(&fields.get_item(0)?)?;
        let last = base + int(&fields.get_item(6)?)?;
        self.advance(base, last)?;
        let (tc, sequence) = (fields.get_item(13)?, fields.get_item(14)?);
        let (tc_value, sequence_value) = (int(&tc)?, int(&sequence)?);
        if tc_value == 0 && sequence_value == 0 {
            return Ok(());
        }
        let attributes = int(&fields.get_item(5)?)?;
        if attributes & 0x10 == 0 {
            return Ok(()); // not transactional
        }
        let key = TxnBuffer::kept_key(&PyTuple::new(py, [tc, sequence])?.into_any())?;
        if attributes & 0x20 != 0 {
            let marker = match marker {
                Some(marker) if !marker.is_none() => marker,
                _ => return Err(assertion("a control batch needs its decoded marker")),
            };
            let (producer_id, producer_epoch) = match self.open_get(key) {
                Some(entry) => (entry.producer_id, entry.producer_epoch),
                None => (int(&fields.get_item(10)?)?, int(&fields.get_item(11)?)?),
            };
            let t = types(py)?;
            let commit = marker.getattr("type")?.as_ptr() == t.commit.as_ptr();
            let epoch = int(&marker.getattr("coordinator_epoch")?)?;
            return self.end(py, key, commit, epoch, base as i64, producer_id, producer_epoch);
        }
        if !self.open_lookup.contains_key(&key) && self.ended_key(key).is_some() {
            self.counters[ANOMALIES] += 1;
            self.unindex_aborted(key);
            self.forget_commit(key);
        }
        let (producer_id, producer_epoch) = (int(&fields.get_item(10)?)?, int(&fields.get_item(11)?)?);
        let timestamp_ms = int(&fields.get_item(3)?)?;
        self.record_data(key, producer_id, producer_epoch, base as i64, last as i64, timestamp_ms);
        Ok(())
    }

    // -- snapshots --

    fn snapshot<'py>(&self, py: Python<'py>, covered_offset: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let covered = int(covered_offset)?;
        if covered <= self.last_applied_offset as i128 {
            return Err(assertion((covered_offset.clone().unbind(), self.last_applied_offset)));
        }
        let epochs = self.sorted_epochs();
        let live = self.committed_lookup.len();
        let mut out = Vec::with_capacity(HEADER_SIZE + TRAILER_SIZE + EPOCH_SIZE * epochs.len()
            + OPEN_SIZE * self.open.len() + ABORTED_SIZE * self.aborted.len() + COMMITTED_SIZE * live);
        out.extend_from_slice(SNAPSHOT_MAGIC);
        out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        put_q(&mut out, py, covered)?;
        put_q(&mut out, py, self.log_start_offset)?;
        put_q(&mut out, py, self.aborted_evicted_below)?;
        for count in [epochs.len(), self.open.len(), self.aborted.len(), live] {
            out.extend_from_slice(&(count as u32).to_le_bytes());
        }
        for (tc, epoch) in &epochs {
            out.extend_from_slice(&tc.to_le_bytes());
            put_u64(&mut out, py, *epoch)?;
        }
        for entry in self.open.values() {
            out.extend_from_slice(&tc_of(entry.key).to_le_bytes());
            out.extend_from_slice(&sequence_of(entry.key).to_le_bytes());
            put_q(&mut out, py, entry.producer_id)?;
            put_u32(&mut out, py, entry.producer_epoch)?;
            out.extend_from_slice(&entry.first_offset.to_le_bytes());
            out.extend_from_slice(&entry.last_offset.to_le_bytes());
            put_q(&mut out, py, entry.first_timestamp_ms)?;
        }
        for entry in &self.aborted {
            out.extend_from_slice(&tc_of(entry.key).to_le_bytes());
            out.extend_from_slice(&sequence_of(entry.key).to_le_bytes());
            out.extend_from_slice(&entry.producer_id.to_le_bytes());
            out.extend_from_slice(&entry.producer_epoch.to_le_bytes());
            out.extend_from_slice(&entry.first_offset.to_le_bytes());
            out.extend_from_slice(&entry.marker_offset.to_le_bytes());
            out.extend_from_slice(&entry.last_stable_offset.to_le_bytes());
            out.push(entry.indexed as u8);
        }
        for (key, marker) in self.live_commits() {
            out.extend_from_slice(&tc_of(*key).to_le_bytes());
            out.extend_from_slice(&sequence_of(*key).to_le_bytes());
            out.extend_from_slice(&marker.to_le_bytes());
        }
        let crc = crc32c::value(&out, 0);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(PyBytes::new(py, &out))
    }

    #[classmethod]
    #[pyo3(signature = (data, limits = None))]
    fn restore(_cls: &Bound<'_, PyType>, py: Python<'_>, data: &Bound<'_, PyAny>,
               limits: Option<Bound<'_, PyAny>>) -> PyResult<(Py<TxnBuffer>, i64)> {
        let decoded = match data.downcast::<PyBytes>() {
            Ok(bytes) => decode(py, bytes.as_bytes())?,
            Err(_) => {
                let bytes = py.get_type::<PyBytes>().call1((data,))?;
                decode(py, bytes.downcast::<PyBytes>()?.as_bytes())?
            }
        };
        let mut buffer = TxnBuffer::build(py, limits)?;
        buffer.log_start_offset = decoded.log_start as i128;
        buffer.aborted_evicted_below = decoded.evicted_below as i128;
        let dict = buffer.epochs_dict.bind(py);
        for (tc, epoch) in &decoded.epochs {
            buffer.epochs.insert(*tc, *epoch as i128);
            dict.set_item(*tc, *epoch)?;
        }
        for (key, producer_id, producer_epoch, first, last, timestamp_ms) in &decoded.open {
            let slot = buffer.open_next;
            buffer.open_next += 1;
            buffer.open.insert(slot, Open {
                key: *key,
                producer_id: *producer_id as i128,
                producer_epoch: *producer_epoch as i128,
                first_offset: *first,
                last_offset: *last,
                first_timestamp_ms: *timestamp_ms as i128,
            });
            buffer.open_lookup.insert(*key, slot);
        }
        for (key, producer_id, producer_epoch, first, marker, lso, indexed) in &decoded.aborted {
            buffer.aborted.push_back(Aborted {
                key: *key,
                producer_id: *producer_id,
                producer_epoch: *producer_epoch,
                first_offset: *first,
                marker_offset: *marker,
                last_stable_offset: *lso,
                indexed: *indexed == 1,
            });
            if *indexed != 0 {
                buffer.aborted_lookup.insert(*key, *marker);
            }
        }
        for (key, marker) in &decoded.committed {
            buffer.committed.push_back((*key, *marker));
            buffer.committed_lookup.insert(*key, *marker);
        }
        buffer.enforce_bounds();
        buffer.last_applied_offset = decoded.covered - 1;
        Ok((Py::new(py, buffer)?, decoded.covered))
    }

    fn __repr__(&self) -> String {
        format!("<native TxnBuffer: {} open, {} aborted, {} remembered commits>",
                self.open.len(), self.aborted.len(), self.committed_lookup.len())
    }
}
