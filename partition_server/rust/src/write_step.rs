//! partition_server/write_step.py's `decide` in Rust (`decide_write_step`): the decision
//! part of a partition owner's write step, on the native tables (ProducerStateTable,
//! TxnBuffer, TxnGuard), which it calls directly, Rust to Rust. The Python function stays
//! the reference (its module doc is the contract): the same signature, the same results
//! appended to each work's `results` (the reference's own classes: Appended, MarkerResult,
//! the AtomlogError objects the tables raise), the same Decided, the same changes to the
//! tables. tests/test_native_write_step.py holds the two together.
//!
//! Python objects are made without calling Python code: Appended and MarkerResult (slots
//! dataclasses) by `object.__new__` and the generic set of their slots (what
//! `object.__setattr__` does), TxnIds and Decided by `tuple.__new__`, the
//! control batch by the native `frame_batch_parsed` around record_batch._control_body
//! (an lru_cache: a C call when it hits). Python code runs only on rare paths:
//! - errors: the tables' AtomlogErrors are made by AtomlogError (Python) as there; the
//!   CONCURRENT_TRANSACTIONS refusal (write_step.verify_again) and STALE_COORDINATOR_EPOCH
//!   (write_step.stale_epoch) are the reference's own functions;
//! - the server's coordinator-epoch lookup (`coordinator_epoch`, CoordinatorEpochs.current)
//!   for a stage: called once per TC partition per group, not once per stage (the
//!   reference calls it per stage; the value can only change on another thread, which
//!   cannot run while this step holds the GIL, so the answers are the same as one of the
//!   reference's runs).
//! Everything else is the reference's path in Rust: duplicates, resolutions, the too-few
//! refusal, tokens and verification failures included.
//!
//! Attribute names are interned once (`intern!`), and results are appended to the works'
//! lists (always lists: `field(default_factory=list)`) directly: a name made and hashed per look-up, and a method looked up per
//! result, were a third of this step's time (2026-12-07: 5.2 to 3.0 µs a work alone,
//! 11-16 to 7-9 µs in the combined server).
//!
//! Integers: offsets, `now` and the counts are i64 here (the log's offsets and wall-clock
//! milliseconds are far within it); a value beyond it raises OverflowError.

use crate::frame_batch_parsed;
use crate::producer_state::ProducerStateTable;
use crate::txn_buffer::TxnBuffer;
use crate::txn_guard::TxnGuard;
use pyo3::prelude::*;
use pyo3::intern;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyList, PyString, PyTuple};

const ATTR_TRANSACTIONAL: i64 = 0x0010;
const ATTR_CONTROL: i64 = 0x0020;
const LENGTH_FIELD_END: i64 = 12;
const NO_SEQUENCE: i64 = -1;

// BatchHeader's fields (record_batch.py), by index.
const H_BATCH_LENGTH: usize = 1;
const H_ATTRIBUTES: usize = 5;
const H_LAST_OFFSET_DELTA: usize = 6;
const H_RECORD_COUNT: usize = 7;
const H_PRODUCER_ID: usize = 10;
const H_PRODUCER_EPOCH: usize = 11;
const H_BASE_SEQUENCE: usize = 12;
const H_TXN_TC: usize = 13;
const H_TXN_SEQUENCE: usize = 14;

/// The Python objects the step reads and makes, looked up once.
struct Refs {
    marker_work: PyObject,
    resolve_work: PyObject,
    appended: PyObject,
    marker_result: PyObject,
    decided: PyObject,
    txn_id: PyObject,
    append: PyObject,
    write: PyObject,
    commit: PyObject,
    control_body: PyObject,
    error: PyObject,
    verify_again: PyObject,
    stale_epoch: PyObject,
    object_new: PyObject,
    tuple_new: PyObject,
}

static REFS: GILOnceCell<Refs> = GILOnceCell::new();

fn refs(py: Python<'_>) -> PyResult<&'static Refs> {
    REFS.get_or_try_init(py, || -> PyResult<Refs> {
        let ws = py.import("partition_server.write_step")?;
        let rb = py.import("partition_server.record_batch")?;
        let object = py.import("builtins")?.getattr("object")?;
        Ok(Refs {
            marker_work: ws.getattr("_MarkerWork")?.unbind(),
            resolve_work: ws.getattr("_ResolveWork")?.unbind(),
            appended: ws.getattr("Appended")?.unbind(),
            marker_result: ws.getattr("MarkerResult")?.unbind(),
            decided: ws.getattr("Decided")?.unbind(),
            txn_id: rb.getattr("TxnId")?.unbind(),
            append: py.import("partition_server.producer_state")?.getattr("APPEND")?.unbind(),
            write: py.import("partition_server.txn_buffer")?.getattr("MarkerAction")?
                .getattr("WRITE")?.unbind(),
            commit: rb.getattr("ControlType")?.getattr("COMMIT")?.unbind(),
            control_body: rb.getattr("_control_body")?.unbind(),
            error: py.import("services.errors")?.getattr("AtomlogError")?.unbind(),
            verify_again: ws.getattr("verify_again")?.unbind(),
            stale_epoch: ws.getattr("stale_epoch")?.unbind(),
            object_new: object.getattr("__new__")?.unbind(),
            tuple_new: py.get_type::<PyTuple>().getattr("__new__")?.unbind(),
        })
    })
}

/// The AtomlogError a table raised, as the result to append; any other error goes on.
fn refusal(py: Python<'_>, r: &Refs, error: PyErr) -> PyResult<PyObject> {
    if error.get_type(py).is(r.error.bind(py)) || error.is_instance(py, r.error.bind(py)) {
        Ok(error.value(py).clone().into_any().unbind())
    } else {
        Err(error)
    }
}

fn appended(py: Python<'_>, r: &Refs, base: &PyObject, last: &PyObject, timestamp: &PyObject,
            duplicate: bool) -> PyResult<PyObject> {
    let object = r.object_new.call1(py, (r.appended.clone_ref(py),))?;
    let bound = object.bind(py);
    bound.setattr(intern!(py, "base_offset"), base)?;
    bound.setattr(intern!(py, "last_offset"), last)?;
    bound.setattr(intern!(py, "log_append_time_ms"), timestamp)?;
    bound.setattr(intern!(py, "duplicate"), duplicate)?;
    Ok(object)
}

fn marker_result(py: Python<'_>, r: &Refs, offset: &PyObject, already_ended: &PyObject)
                 -> PyResult<PyObject> {
    // A frozen dataclass with slots: its fields are set as its own __init__ sets them
    // (object.__setattr__, which is the generic set of the slots' descriptors).
    let object = r.object_new.call1(py, (r.marker_result.clone_ref(py),))?;
    set_generic(py, &object, intern!(py, "marker_offset"), offset)?;
    set_generic(py, &object, intern!(py, "already_ended"), already_ended)?;
    Ok(object)
}

/// object.__setattr__(object, name, value), without a Python call.
fn set_generic(py: Python<'_>, object: &PyObject, name: &Bound<'_, PyString>, value: &PyObject)
               -> PyResult<()> {
    // SAFETY: three live references held for the call, under the GIL.
    let status = unsafe {
        pyo3::ffi::PyObject_GenericSetAttr(object.as_ptr(), name.as_ptr(), value.as_ptr())
    };
    if status < 0 {
        return Err(PyErr::fetch(py));
    }
    Ok(())
}

fn int(py: Python<'_>, value: i64) -> PyObject {
    value.into_pyobject(py).expect("an int").into_any().unbind()
}

/// decide(group, now, next_offset, too_few, producers, txns, guard, name,
/// coordinator_epoch) -> Decided: write_step.decide on the native tables.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn decide_write_step(
    py: Python<'_>,
    group: &Bound<'_, PyAny>,
    now: i64,
    next_offset: i64,
    too_few: &Bound<'_, PyAny>,
    producers: &Bound<'_, ProducerStateTable>,
    txns: &Bound<'_, TxnBuffer>,
    guard: &Bound<'_, TxnGuard>,
    name: &Bound<'_, PyAny>,
    coordinator_epoch: &Bound<'_, PyAny>,
) -> PyResult<PyObject> {
    let r = refs(py)?;
    let now_object = now.into_pyobject(py)?.into_any();
    let too_few = if too_few.is_none() { None } else { Some(too_few) };
    let accepted = PyList::empty(py);
    let expected_bases = PyList::empty(py);
    let mut next_offset = next_offset;
    let (mut duplicates, mut records, mut appended_bytes) = (0i64, 0i64, 0i64);
    let (mut commits, mut aborts) = (0i64, 0i64);
    let mut last_control: Option<i64> = None;
    // The server's epochs per TC partition, as read at this step (see the module doc).
    let mut known_epochs: Vec<(PyObject, PyObject)> = Vec::new();
    let minus_one = int(py, -1);
    let none = py.None();
    let true_object = true.into_pyobject(py)?.to_owned().into_any().unbind();
    let false_object = false.into_pyobject(py)?.to_owned().into_any().unbind();
    for work in group.try_iter()? {
        let work = work?;
        let results = work.getattr(intern!(py, "results"))?.downcast_into::<PyList>()?;
        if work.is_instance(r.marker_work.bind(py))? {
            for marker in work.getattr(intern!(py, "markers"))?.try_iter()? {
                let marker = marker?;
                let txn = marker.getattr(intern!(py, "txn"))?;
                let decision = marker.getattr(intern!(py, "decision"))?;
                let epoch = marker.getattr(intern!(py, "coordinator_epoch"))?;
                let offset = next_offset;
                let framed = (|| -> PyResult<Option<PyObject>> {
                    let plan = txns.borrow_mut().check_marker(py, &txn, &decision, &epoch)?;
                    guard.borrow_mut().on_marker(&txn)?;
                    let plan = plan.bind(py);
                    if !plan.getattr(intern!(py, "action"))?.is(r.write.bind(py)) {
                        let already = plan.getattr(intern!(py, "already_ended"))?.unbind();
                        results.append(marker_result(py, r, &minus_one, &already)?)?;
                        return Ok(None);
                    }
                    let (producer_id, producer_epoch) =
                        (plan.getattr(intern!(py, "producer_id"))?, plan.getattr(intern!(py, "producer_epoch"))?);
                    let body = r.control_body.call1(py, (decision.extract::<i64>()?, &epoch))?;
                    let control = true_object.bind(py);
                    let (batch, header) = frame_batch_parsed(
                        py, body.bind(py), crate::MAGIC as i64, 1, now, now, None,
                        producer_id.extract()?, producer_epoch.extract()?, NO_SEQUENCE,
                        Some(&txn), None, Some(control))?;
                    let offset_object = int(py, offset);
                    let offset_bound = offset_object.bind(py);
                    producers.borrow_mut().apply(
                        py, &producer_id, &producer_epoch, minus_one.bind(py), minus_one.bind(py),
                        offset_bound, offset_bound, &now_object, Some(control))?;
                    txns.borrow_mut().on_marker(py, &txn, &decision, &epoch, offset_bound)?;
                    results.append(marker_result(py, r, &offset_object, &false_object)?)?;
                    Ok(Some(PyTuple::new(py, [batch, header])?.into_any().unbind()))
                })();
                match framed {
                    Ok(Some(framed)) => {
                        last_control = Some(offset);
                        if decision.is(r.commit.bind(py)) || decision.eq(r.commit.bind(py))? {
                            commits += 1;
                        } else {
                            aborts += 1;
                        }
                        accepted.append(framed)?;
                        expected_bases.append(offset)?;
                        next_offset += 1;
                    }
                    Ok(None) => {}
                    Err(error) => {
                        results.append(refusal(py, r, error)?)?;
                    }
                }
            }
            continue;
        }
        if work.is_instance(r.resolve_work.bind(py))? {
            let txn = work.getattr(intern!(py, "txn"))?;
            let answer = (|| -> PyResult<PyObject> {
                if txns.borrow().open_transaction(py, &txn)?.is_some() {
                    return Ok(true_object.clone_ref(py));
                }
                let ended = txns.borrow().ended(py, &txn)?;
                let committed = match ended {
                    Some((decision, _)) => decision.bind(py).is(r.commit.bind(py)),
                    None => false,
                };
                Ok(if committed { true_object.clone_ref(py) } else { false_object.clone_ref(py) })
            })();
            let answer = match answer {
                Ok(answer) => answer,
                Err(error) => refusal(py, r, error)?,
            };
            results.append(answer)?;
            continue;
        }
        let staged = work.getattr(intern!(py, "staged"))?;
        let staged = if staged.is_none() { None } else { Some(staged) };
        if let Some(staged) = &staged {
            let stage_epoch = work.getattr(intern!(py, "stage_epoch"))?;
            let refused = (|| -> PyResult<Option<PyObject>> {
                if let Some(existing) = txns.borrow().open_transaction(py, staged)? {
                    let existing = existing.bind(py);
                    return Ok(Some(appended(
                        py, r, &existing.getattr(intern!(py, "first_offset"))?.unbind(),
                        &existing.getattr(intern!(py, "last_offset"))?.unbind(),
                        &existing.getattr(intern!(py, "first_timestamp_ms"))?.unbind(), true)?));
                }
                let tc = staged.getattr(intern!(py, "tc_partition"))?;
                let mut known = None;
                for (seen, epoch) in &known_epochs {
                    if seen.bind(py).eq(&tc)? {
                        known = Some(epoch.clone_ref(py));
                        break;
                    }
                }
                let known = match known {
                    Some(known) => known,
                    None => {
                        let epoch = if coordinator_epoch.is_truthy()? {
                            coordinator_epoch.call1((&tc,))?.unbind()
                        } else {
                            int(py, 0)
                        };
                        known_epochs.push((tc.clone().unbind(), epoch.clone_ref(py)));
                        epoch
                    }
                };
                let written = txns.borrow().coordinator_epochs(py).bind(py).call_method1(intern!(py, "get"), (&tc, 0))?;
                let known = known.into_bound(py);
                // max(known, written): the first of equals, as Python's max
                let current = if written.gt(&known)? { written } else { known };
                if stage_epoch.lt(&current)? {
                    return Ok(Some(r.stale_epoch.call1(py, (name, staged, &stage_epoch, &current))?));
                }
                let zero = int(py, 0);
                txns.borrow_mut().check_write(py, staged, zero.bind(py), zero.bind(py))?;
                Ok(None)
            })();
            let refused = match refused {
                Ok(refused) => refused,
                Err(error) => Some(refusal(py, r, error)?),
            };
            if let Some(refused) = refused {
                results.append(refused)?;
                continue;
            }
        }
        let tokens = work.getattr(intern!(py, "tokens"))?;
        let tokens = if tokens.is_truthy()? { Some(tokens) } else { None };
        for (index, item) in work.getattr(intern!(py, "batches"))?.try_iter()?.enumerate() {
            let item = item?;
            let header = item.get_item(1)?;
            let header = header.downcast::<PyTuple>()?;
            let field = |at: usize| header.get_item(at);
            let (producer_id, producer_epoch) = (field(H_PRODUCER_ID)?, field(H_PRODUCER_EPOCH)?);
            let (base_sequence, record_count) = (field(H_BASE_SEQUENCE)?, field(H_RECORD_COUNT)?);
            let attributes: i64 = field(H_ATTRIBUTES)?.extract()?;
            let transactional = attributes & ATTR_TRANSACTIONAL != 0;
            let checked = (|| -> PyResult<(PyObject, Option<PyObject>)> {
                let decision = producers.borrow_mut().check(
                    py, &producer_id, &producer_epoch, &base_sequence, &record_count, &now_object)?;
                let is_append = decision.bind(py).is(r.append.bind(py));
                let mut txn = None;
                if transactional && is_append {
                    txn = Some(txn_of(py, r, header)?);
                }
                if is_append && transactional && staged.is_none() {
                    let token = match &tokens {
                        Some(tokens) => Some(tokens.get_item(index)?),
                        None => None,
                    };
                    let txn = txn.as_ref().expect("a transactional batch's txn").bind(py);
                    // _check_transactional
                    if let Some(token) = &token {
                        if token.is_instance(r.error.bind(py))? {
                            return Err(PyErr::from_value(token.clone()));
                        }
                    }
                    if txns.borrow().open_transaction(py, txn)?.is_none() {
                        let allowed = match &token {
                            Some(token) if !token.is_none() => {
                                // (the reference's allows: its key first, then the token)
                                let key = crate::txn_guard::txn_key(txn)?;
                                guard.borrow().allows_key(key, token)?
                            }
                            _ => false,
                        };
                        if !allowed {
                            let error = r.verify_again.call1(py, (name, txn))?;
                            return Err(PyErr::from_value(error.into_bound(py)));
                        }
                    }
                    txns.borrow_mut().check_write(py, txn, &producer_id, &producer_epoch)?;
                }
                Ok((decision, txn))
            })();
            let (decision, txn) = match checked {
                Ok(checked) => checked,
                Err(error) => {
                    results.append(refusal(py, r, error)?)?;
                    continue;
                }
            };
            let decision = decision.into_bound(py);
            let is_append = decision.is(r.append.bind(py));
            if is_append {
                if let Some(too_few) = too_few {
                    results.append(too_few)?;
                    continue;
                }
                let delta: i64 = field(H_LAST_OFFSET_DELTA)?.extract()?;
                let last = next_offset + delta;
                let base: i64 = base_sequence.extract()?;
                let last_sequence = if base == NO_SEQUENCE {
                    minus_one.clone_ref(py)
                } else {
                    int(py, base + delta)
                };
                let (first_object, last_object) = (int(py, next_offset), int(py, last));
                let control = (attributes & ATTR_CONTROL != 0).into_pyobject(py)?.to_owned().into_any();
                producers.borrow_mut().apply(
                    py, &producer_id, &producer_epoch, &base_sequence, last_sequence.bind(py),
                    first_object.bind(py), last_object.bind(py), &now_object, Some(&control))?;
                if transactional {
                    let txn = match txn {
                        Some(txn) => txn,
                        None => none.clone_ref(py),
                    };
                    txns.borrow_mut().on_data(txn.bind(py), &producer_id, &producer_epoch,
                                              first_object.bind(py), last_object.bind(py),
                                              &now_object)?;
                }
                let now_ref = now_object.clone().unbind();
                results.append(appended(py, r, &first_object, &last_object, &now_ref, false)?)?;
                accepted.append(&item)?;
                expected_bases.append(&first_object)?;
                records += record_count.extract::<i64>()?;
                appended_bytes += field(H_BATCH_LENGTH)?.extract::<i64>()? + LENGTH_FIELD_END;
                next_offset = last + 1;
            } else {
                duplicates += 1;
                let result = appended(
                    py, r, &decision.getattr(intern!(py, "base_offset"))?.unbind(),
                    &decision.getattr(intern!(py, "last_offset"))?.unbind(),
                    &decision.getattr(intern!(py, "timestamp_ms"))?.unbind(), true)?;
                results.append(result)?;
            }
        }
    }
    let last_control = match last_control {
        Some(offset) => int(py, offset),
        None => py.None(),
    };
    let fields = PyTuple::new(py, [
        accepted.into_any().unbind(), expected_bases.into_any().unbind(), int(py, next_offset),
        int(py, duplicates), int(py, records), int(py, appended_bytes), int(py, commits),
        int(py, aborts), last_control,
    ])?;
    r.tuple_new.call1(py, (r.decided.clone_ref(py), fields))
}

/// header.txn: None for (0, 0), else a TxnId.
fn txn_of(py: Python<'_>, r: &Refs, header: &Bound<'_, PyTuple>) -> PyResult<PyObject> {
    let (tc, sequence) = (header.get_item(H_TXN_TC)?, header.get_item(H_TXN_SEQUENCE)?);
    if tc.eq(0)? && sequence.eq(0)? {
        return Ok(py.None());
    }
    r.tuple_new.call1(py, (r.txn_id.clone_ref(py), (tc, sequence)))
}
