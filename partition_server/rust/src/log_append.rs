//! A partition log's append of a group of batches in one call (`log_append_step`): what
//! PartitionLog's Python path does with `plan_log_append`, `_write_planned` and the
//! write-ahead file's `frame_parts`, less the I/O. The group is checked (the errors of
//! `plan_log_append`, in its order), stamped into one buffer, and accounted for; when the
//! log has a write-ahead file, the DATA frame's head is built over that buffer (the bytes
//! of wal.frame_parts: CRC-32C over the head and the payload) without a copy of it.
//! PartitionLog writes the buffer, queues the frame, and then has `AppendFacts.apply` put
//! the batches' starts and index entries into its own objects.
//!
//! The Python path stays the reference: tests/test_native_log_append.py drives a log on
//! each and compares the files, the frames, the offsets and every fact.

use crate::{check_log_append, crc32c, log_items, struct_error, ATTR_CONTROL, LENGTH_FIELD_END,
            PREFIX_SIZE};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

/// wal.DATA, wal.HEADER_SIZE and wal.LENGTH_END: a frame's kind, its head's size before
/// the name, and where the bytes its `length` counts begin.
const FRAME_DATA: u8 = 1;
const FRAME_HEADER_SIZE: usize = 18;
const FRAME_LENGTH_END: usize = 8;

/// What an append leaves for the log's own objects once its bytes are written: each
/// batch's (base offset, position), the index entries (offset, position, max timestamp
/// before) and the index's running max timestamp after.
#[pyclass(module = "partition_server._native", frozen)]
pub struct AppendFacts {
    starts: Vec<(i64, i64)>,
    entries: Vec<(i64, i64, i64)>,
    running_max_ts: i64,
}

#[pymethods]
impl AppendFacts {
    /// What PartitionLog._write_planned does with starts and entries: `recent[base] =
    /// (segment, position)` for each batch, then the oldest dropped until `limit` remain;
    /// each entry appended to `index`'s offsets, positions and max_timestamps_before, and
    /// its running_max_timestamp_ms set.
    fn apply(&self, py: Python<'_>, segment: &Bound<'_, PyAny>, index: &Bound<'_, PyAny>,
             recent: &Bound<'_, PyDict>, limit: usize) -> PyResult<()> {
        for (base, position) in &self.starts {
            let position = position.into_pyobject(py)?.into_any();
            let start = PyTuple::new(py, [segment.clone(), position])?;
            recent.set_item(base, start)?;
        }
        while recent.len() > limit {
            let oldest = match recent.iter().next() {
                Some((key, _)) => key,
                None => break,
            };
            recent.del_item(oldest)?;
        }
        if !self.entries.is_empty() {
            let append = intern!(py, "append");
            let offsets = index.getattr(intern!(py, "offsets"))?;
            let positions = index.getattr(intern!(py, "positions"))?;
            let befores = index.getattr(intern!(py, "max_timestamps_before"))?;
            for (offset, position, before) in &self.entries {
                offsets.call_method1(append, (offset,))?;
                positions.call_method1(append, (position,))?;
                befores.call_method1(append, (before,))?;
            }
        }
        index.setattr(intern!(py, "running_max_timestamp_ms"), self.running_max_ts)
    }
}

/// A log's append of `group` onto the active segment at `now` (the arguments of
/// record_batch.plan_log_append, then `frame_name`: the write-ahead file's name of the
/// log, None when it has none). Raises plan_log_append's errors; None when a batch
/// would roll the segment. Else (data, head, next_offset, bases, end, max_ts, last_data,
/// facts): the batches stamped, as one bytes; the write-ahead DATA frame's head (CRC,
/// length, kind, name length, offset `next_offset`, name) whose payload is `data`, None
/// without `frame_name` or when wal.frame_parts would refuse it (the caller then asks it,
/// to raise its error); the offset after; each batch's base offset; the segment's size
/// after; the largest max timestamp of the batches; the last offset of the last
/// non-control batch (None if none); the AppendFacts.
#[pyfunction]
#[pyo3(signature = (group, next_offset, now, max_batch_bytes, size, first_time, segment_base,
                    segment_bytes, segment_ms, interval_bytes, last_indexed, running_max_ts,
                    frame_name))]
#[allow(clippy::too_many_arguments)]
pub fn log_append_step(
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
    frame_name: Option<Bound<'_, PyBytes>>,
) -> PyResult<Option<PyObject>> {
    let items = log_items(group)?;
    if !check_log_append(py, &items, next_offset, now, max_batch_bytes, size, first_time,
                         segment_base, segment_bytes, segment_ms)? {
        return Ok(None);
    }
    // stamp_for_log's buffer, and plan_log_append's accounting, in one pass.
    let total: usize = items
        .iter()
        .map(|item| item.view.bytes().len().saturating_sub(PREFIX_SIZE) + PREFIX_SIZE)
        .sum();
    let mut bases = Vec::with_capacity(items.len());
    let mut starts = Vec::with_capacity(items.len());
    let mut entries = Vec::new();
    let (mut position, mut last_indexed, mut running) = (size, last_indexed, running_max_ts);
    let (mut max_ts, mut last_data) = (i64::MIN, None);
    let mut offset = next_offset;
    for item in &items {
        bases.push(offset);
        starts.push((offset, position));
        if last_indexed.map_or(true, |last| position - last >= interval_bytes) {
            entries.push((offset, position, running));
            last_indexed = Some(position);
        }
        running = running.max(item.max_timestamp_ms);
        max_ts = max_ts.max(item.max_timestamp_ms);
        if item.attributes & ATTR_CONTROL == 0 {
            last_data = Some(offset + item.last_offset_delta as i64);
        }
        position += item.batch_length as i64 + LENGTH_FIELD_END;
        offset = offset
            .checked_add(item.last_offset_delta as i64 + 1)
            .ok_or_else(|| struct_error(py, "argument out of range"))?;
    }
    let data = PyBytes::new_with(py, total, |out| {
        let mut at = 0;
        for (item, base) in items.iter().zip(&bases) {
            let rest = item.view.bytes().get(PREFIX_SIZE..).unwrap_or(&[]);
            out[at..at + 8].copy_from_slice(&base.to_be_bytes());
            out[at + 8..at + 12].copy_from_slice(&item.batch_length.to_be_bytes());
            out[at + 12] = item.magic as u8;
            out[at + 13..at + PREFIX_SIZE].copy_from_slice(&now.to_be_bytes());
            out[at + PREFIX_SIZE..at + PREFIX_SIZE + rest.len()].copy_from_slice(rest);
            at += PREFIX_SIZE + rest.len();
        }
        Ok(())
    })?;
    let head = match frame_name {
        Some(name) => frame_head(py, name.as_bytes(), next_offset, data.as_bytes()),
        None => None,
    };
    let facts = Bound::new(py, AppendFacts { starts, entries, running_max_ts: running })?;
    let answer = PyTuple::new(
        py,
        [
            data.into_any(),
            head.into_pyobject(py)?.into_any(),
            offset.into_pyobject(py)?.into_any(),
            PyList::new(py, bases)?.into_any(),
            position.into_pyobject(py)?.into_any(),
            max_ts.into_pyobject(py)?.into_any(),
            last_data.into_pyobject(py)?.into_any(),
            facts.into_any(),
        ],
    )?;
    Ok(Some(answer.into_any().unbind()))
}

/// wal.frame_parts(DATA, name, offset, payload)'s head: CRC-32C (of the rest of the head,
/// then the payload) | length | kind | name length | offset | name. None where
/// frame_parts raises (a name not of 1-255 bytes, a length beyond 32 bits).
fn frame_head<'py>(py: Python<'py>, name: &[u8], offset: i64, payload: &[u8])
                   -> Option<Bound<'py, PyBytes>> {
    if name.is_empty() || name.len() > 255 {
        return None;
    }
    let length = FRAME_HEADER_SIZE - FRAME_LENGTH_END + name.len() + payload.len();
    let length = u32::try_from(length).ok()?;
    let mut head = Vec::with_capacity(FRAME_HEADER_SIZE + name.len());
    head.extend_from_slice(&[0u8; 4]);
    head.extend_from_slice(&length.to_be_bytes());
    head.push(FRAME_DATA);
    head.push(name.len() as u8);
    head.extend_from_slice(&offset.to_be_bytes());
    head.extend_from_slice(name);
    let crc = crc32c::value(payload, crc32c::value(&head[4..], 0));
    head[..4].copy_from_slice(&crc.to_be_bytes());
    Some(PyBytes::new(py, &head))
}
