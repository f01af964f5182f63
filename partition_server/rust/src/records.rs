//! coordinator/records.py's `encode_record` in Rust: the value of a TC partition's log
//! record (`__txn_log-<k>`), byte for byte the reference's (that module's doc has the
//! layout; its `Writer` helpers `pack`, `string`, `txn_id`, `txn_ids`, `targets` and
//! `session` are the functions below of the same names).
//!
//! The fast path takes the records the coordinator builds: one of the nine record
//! classes exactly, its fields of the types their constructors check (ints, str, tuples
//! of the exact id and target types, None). Anything else it does not refuse itself: a
//! record of another type, a field of another type, an int out of its field's range, a
//! string that is not UTF-8 or over 65,535 bytes, a list too long for its count, any
//! error while reading a field. It hands the record to the reference (the Python
//! `encode_record`, given by `init_records`), which raises its own error, with its own
//! message, or encodes what it accepts. So what this function answers or raises is the
//! reference's by construction outside the fast path, and the fast path is held to it by
//! tests/test_native_records.py.
//!
//! Pure: no state but the classes and the reference `init_records` is given.

use pyo3::exceptions::PyRuntimeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple, PyType};

/// The record classes and the codes of their types, from coordinator/records.py.
struct Refs {
    opened: (Py<PyType>, u8),
    staging: (Py<PyType>, u8),
    registered: (Py<PyType>, u8),
    deadline_reset: (Py<PyType>, u8),
    prepared: (Py<PyType>, u8),
    decided: (Py<PyType>, u8),
    completed: (Py<PyType>, u8),
    session_started: (Py<PyType>, u8),
    sequences_reserved: (Py<PyType>, u8),
    session_bumped: u8,
    version: u8,
    txn_id: Py<PyType>,
    topic_partition: Py<PyType>,
    subscription_partition: Py<PyType>,
    reference: PyObject,
}

static REFS: GILOnceCell<Refs> = GILOnceCell::new();

/// Called once by coordinator/records.py when it loads: its RECORD_TYPES (class -> type
/// code), SESSION_BUMPED_TYPE, RECORD_FORMAT_VERSION, the id and target classes, and its
/// own `encode_record` (the reference, for what the fast path does not take).
#[pyfunction]
#[pyo3(signature = (record_types, session_bumped_type, format_version, txn_id,
                    topic_partition, subscription_partition, reference))]
#[allow(clippy::too_many_arguments)]
pub fn init_records(
    py: Python<'_>,
    record_types: Bound<'_, PyDict>,
    session_bumped_type: u8,
    format_version: u8,
    txn_id: Bound<'_, PyType>,
    topic_partition: Bound<'_, PyType>,
    subscription_partition: Bound<'_, PyType>,
    reference: PyObject,
) -> PyResult<()> {
    let class = |name: &str| -> PyResult<(Py<PyType>, u8)> {
        for (key, code) in record_types.iter() {
            let key = key.downcast_into::<PyType>()?;
            if key.getattr(intern!(py, "__name__"))?.extract::<String>()? == name {
                return Ok((key.unbind(), code.extract::<u8>()?));
            }
        }
        Err(PyRuntimeError::new_err(format!("init_records: no record class {name}")))
    };
    let refs = Refs {
        opened: class("Opened")?,
        staging: class("Staging")?,
        registered: class("Registered")?,
        deadline_reset: class("DeadlineReset")?,
        prepared: class("Prepared")?,
        decided: class("Decided")?,
        completed: class("Completed")?,
        session_started: class("SessionStarted")?,
        sequences_reserved: class("SequencesReserved")?,
        session_bumped: session_bumped_type,
        version: format_version,
        txn_id: txn_id.unbind(),
        topic_partition: topic_partition.unbind(),
        subscription_partition: subscription_partition.unbind(),
        reference,
    };
    let _ = REFS.set(py, refs);
    Ok(())
}

/// The record value to append to `__txn_log-<k>` (records.py's `encode_record`).
#[pyfunction]
pub fn encode_record<'py>(py: Python<'py>, record: &Bound<'py, PyAny>) -> PyResult<PyObject> {
    let refs = REFS.get(py).ok_or_else(|| {
        PyRuntimeError::new_err("partition_server._native: coordinator.records calls init_records")
    })?;
    let mut out = Vec::with_capacity(96);
    match encode(py, refs, record, &mut out) {
        Some(()) => Ok(PyBytes::new(py, &out).into_any().unbind()),
        None => refs.reference.call1(py, (record,)),
    }
}

/// `Some` with the record's bytes in `out`, or `None` for the reference to answer.
fn encode(py: Python<'_>, refs: &Refs, record: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> Option<()> {
    let class = record.get_type();
    let is = |of: &(Py<PyType>, u8)| class.is(of.0.bind(py));
    // The commonest first: two of these a one-call transaction, then its Staging.
    if is(&refs.completed) {
        head(refs, refs.completed.1, out);
        txn_id(py, refs, &field(record, intern!(py, "txn_id"))?, out)?;
        let decision = field(record, intern!(py, "decision"))?;
        out.push(int::<u8>(&field(&decision, intern!(py, "_value_"))?)?);
        pack_i64(record, intern!(py, "completed_ms"), out)
    } else if is(&refs.decided) {
        head(refs, refs.decided.1, out);
        txn_id(py, refs, &field(record, intern!(py, "txn_id"))?, out)?;
        let decision = field(record, intern!(py, "decision"))?;
        let cause = field(record, intern!(py, "cause"))?;
        out.push(int::<u8>(&field(&decision, intern!(py, "_value_"))?)?);
        out.push(int::<u8>(&field(&cause, intern!(py, "_value_"))?)?);
        pack_i64(record, intern!(py, "decided_ms"), out)?;
        txn_ids(py, refs, &field(record, intern!(py, "kept_children"))?, out)?;
        txn_ids(py, refs, &field(record, intern!(py, "aborted_children"))?, out)
    } else if is(&refs.staging) || is(&refs.opened) {
        head(refs, if is(&refs.staging) { refs.staging.1 } else { refs.opened.1 }, out);
        txn_id(py, refs, &field(record, intern!(py, "txn_id"))?, out)?;
        pack_i64(record, intern!(py, "created_ms"), out)?;
        pack_u32(record, intern!(py, "timeout_ms"), out)?;
        pack_i64(record, intern!(py, "deadline_ms"), out)?;
        txn_id(py, refs, &field(record, intern!(py, "parent"))?, out)?;
        session(py, &field(record, intern!(py, "session"))?, out)?;
        string(&field(record, intern!(py, "idempotency_key"))?, out)?;
        targets(py, refs, record, out)
    } else if is(&refs.registered) {
        head(refs, refs.registered.1, out);
        txn_id(py, refs, &field(record, intern!(py, "txn_id"))?, out)?;
        targets(py, refs, record, out)
    } else if is(&refs.prepared) {
        head(refs, refs.prepared.1, out);
        txn_id(py, refs, &field(record, intern!(py, "txn_id"))?, out)?;
        pack_i64(record, intern!(py, "prepared_ms"), out)?;
        pack_u32(record, intern!(py, "prepared_timeout_ms"), out)
    } else if is(&refs.deadline_reset) {
        head(refs, refs.deadline_reset.1, out);
        txn_id(py, refs, &field(record, intern!(py, "txn_id"))?, out)?;
        pack_i64(record, intern!(py, "deadline_ms"), out)
    } else if is(&refs.session_started) {
        // Type 7, or 10 with the session it replaced (`bumped_from`: the producer id not 0).
        let bumped_id = int::<i64>(&field(record, intern!(py, "bumped_from_producer_id"))?)?;
        let code = if bumped_id == 0 { refs.session_started.1 } else { refs.session_bumped };
        head(refs, code, out);
        string(&field(record, intern!(py, "transactional_id"))?, out)?;
        pack_i64(record, intern!(py, "producer_id"), out)?;
        pack_u16(record, intern!(py, "producer_epoch"), out)?;
        pack_u32(record, intern!(py, "timeout_ms"), out)?;
        pack_i64(record, intern!(py, "started_ms"), out)?;
        if bumped_id != 0 {
            out.extend_from_slice(&bumped_id.to_le_bytes());
            pack_u16(record, intern!(py, "bumped_from_epoch"), out)?;
        }
        Some(())
    } else if is(&refs.sequences_reserved) {
        head(refs, refs.sequences_reserved.1, out);
        let up_to = int::<u64>(&field(record, intern!(py, "up_to"))?)?;
        out.extend_from_slice(&up_to.to_le_bytes());
        Some(())
    } else {
        None // another type (a subclass, or not a record): the reference's KeyError
    }
}

fn head(refs: &Refs, code: u8, out: &mut Vec<u8>) {
    out.push(refs.version);
    out.push(code);
}

fn field<'py>(object: &Bound<'py, PyAny>, name: &Bound<'py, PyString>) -> Option<Bound<'py, PyAny>> {
    object.getattr(name).ok()
}

/// An int in the range of T (struct's: `__index__` too; bool is an int).
fn int<'py, T: FromPyObject<'py>>(value: &Bound<'py, PyAny>) -> Option<T> {
    value.extract::<T>().ok()
}

fn pack_i64(record: &Bound<'_, PyAny>, name: &Bound<'_, PyString>, out: &mut Vec<u8>) -> Option<()> {
    out.extend_from_slice(&int::<i64>(&field(record, name)?)?.to_le_bytes());
    Some(())
}

fn pack_u32(record: &Bound<'_, PyAny>, name: &Bound<'_, PyString>, out: &mut Vec<u8>) -> Option<()> {
    out.extend_from_slice(&int::<u32>(&field(record, name)?)?.to_le_bytes());
    Some(())
}

fn pack_u16(record: &Bound<'_, PyAny>, name: &Bound<'_, PyString>, out: &mut Vec<u8>) -> Option<()> {
    out.extend_from_slice(&int::<u16>(&field(record, name)?)?.to_le_bytes());
    Some(())
}

/// Writer.string: length u16, UTF-8 bytes. Only an exact str (a subclass may encode
/// otherwise), UTF-8 (no lone surrogates) and at most 65,535 bytes.
fn string(value: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> Option<()> {
    let value = value.downcast_exact::<PyString>().ok()?;
    let data = value.to_str().ok()?.as_bytes();
    if data.len() > 0xFFFF {
        return None;
    }
    out.extend_from_slice(&(data.len() as u16).to_le_bytes());
    out.extend_from_slice(data);
    Some(())
}

/// Writer.txn_id: tc_partition u32, sequence u64; None is (0, 0).
fn txn_id(py: Python<'_>, refs: &Refs, value: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> Option<()> {
    let (tc_partition, sequence) = if value.is_none() {
        (0u32, 0u64)
    } else if value.get_type().is(refs.txn_id.bind(py)) {
        let fields = value.downcast::<PyTuple>().ok()?;
        (int::<u32>(&fields.get_item(0).ok()?)?, int::<u64>(&fields.get_item(1).ok()?)?)
    } else {
        (
            int::<u32>(&field(value, intern!(py, "tc_partition"))?)?,
            int::<u64>(&field(value, intern!(py, "sequence"))?)?,
        )
    };
    out.extend_from_slice(&tc_partition.to_le_bytes());
    out.extend_from_slice(&sequence.to_le_bytes());
    Some(())
}

/// Writer.txn_ids: count u32, then the ids (a tuple, as the records hold them).
fn txn_ids(py: Python<'_>, refs: &Refs, values: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> Option<()> {
    let values = values.downcast_exact::<PyTuple>().ok()?;
    let count = u32::try_from(values.len()).ok()?;
    out.extend_from_slice(&count.to_le_bytes());
    for value in values.iter() {
        txn_id(py, refs, &value, out)?;
    }
    Some(())
}

/// Writer.targets: count u16 and the topic partitions (topic string, partition u32),
/// count u16 and the subscription partitions (topic, partition, subscription string).
/// Exact tuples of the exact target types (their fields are the tuple's items).
fn targets(py: Python<'_>, refs: &Refs, record: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> Option<()> {
    let topic_partitions = field(record, intern!(py, "topic_partitions"))?;
    let subscription_partitions = field(record, intern!(py, "subscription_partitions"))?;
    for (items, class, subscriptions) in [
        (topic_partitions, &refs.topic_partition, false),
        (subscription_partitions, &refs.subscription_partition, true),
    ] {
        let items = items.downcast_exact::<PyTuple>().ok()?;
        let count = u16::try_from(items.len()).ok()?;
        out.extend_from_slice(&count.to_le_bytes());
        for item in items.iter() {
            if !item.get_type().is(class.bind(py)) {
                return None;
            }
            let item = item.downcast::<PyTuple>().ok()?;
            string(&item.get_item(0).ok()?, out)?;
            out.extend_from_slice(&int::<u32>(&item.get_item(1).ok()?)?.to_le_bytes());
            if subscriptions {
                string(&item.get_item(2).ok()?, out)?;
            }
        }
    }
    Some(())
}

/// Writer.session: transactional id string, producer id i64, epoch u16; None is ("", 0, 0).
fn session(py: Python<'_>, value: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> Option<()> {
    if value.is_none() {
        out.extend_from_slice(&[0u8; 2 + 8 + 2]);
        return Some(());
    }
    string(&field(value, intern!(py, "transactional_id"))?, out)?;
    pack_i64(value, intern!(py, "producer_id"), out)?;
    pack_u16(value, intern!(py, "producer_epoch"), out)
}
