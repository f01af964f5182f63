//! partition_server/txn_guard.py's TxnGuard in Rust: the verification cache and late-write
//! guard of one partition (see that module's doc, which is the contract). A drop-in
//! replacement: the same constructor, methods, properties and answers (`cached` gives the
//! reference's own `Verified` objects). The owner's native write step
//! (write_step.rs) calls `allows_key` and `on_marker_key` directly.
//!
//! Differences, outside what the partition server gives it: a transaction id is any
//! 2-tuple of ints (the reference reads `txn.tc_partition`/`txn.sequence`, so needs a
//! TxnId); ids out of range (TC partition >= 2**32 or sequence >= 2**64, or negative)
//! raise OverflowError before anything changes (the reference's `on_marker` raises it
//! from its arrays after it has recorded the marker); tokens are compared as Python ints.
//! The private fields the reference's tests look at (`_ended`, `_ended_order`, ...) are
//! not there.

use pyo3::exceptions::{PyAssertionError, PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyTuple;
use std::collections::{BTreeMap, HashMap, VecDeque};

const DEFAULT_MAX_CACHED: i64 = 100_000;
const DEFAULT_MAX_ENDED: i64 = 100_000;

/// txn_key: TC partition << 64 | sequence.
pub(crate) type Key = u128;

pub(crate) fn key_of(tc: u32, sequence: u64) -> Key {
    (tc as u128) << 64 | sequence as u128
}

static VERIFIED: GILOnceCell<PyObject> = GILOnceCell::new();

fn verified_type(py: Python<'_>) -> PyResult<&PyObject> {
    VERIFIED.get_or_try_init(py, || {
        Ok(py.import("partition_server.txn_guard")?.getattr("Verified")?.unbind())
    })
}

/// The key of a transaction id (a 2-tuple of ints in range).
pub(crate) fn txn_key(txn: &Bound<'_, PyAny>) -> PyResult<Key> {
    let fields = match txn.downcast::<PyTuple>() {
        Ok(fields) if fields.len() == 2 => fields,
        _ => return Err(PyTypeError::new_err("a transaction id is a (tc_partition, sequence) tuple")),
    };
    match (fields.get_item(0)?.extract::<u32>(), fields.get_item(1)?.extract::<u64>()) {
        (Ok(tc), Ok(sequence)) => Ok(key_of(tc, sequence)),
        _ => Err(PyOverflowError::new_err(
            "partition_server._native.TxnGuard: transaction ids are within (2**32, 2**64)",
        )),
    }
}

/// A token compared with the horizon as Python compares ints.
fn token_at_least(token: &Bound<'_, PyAny>, horizon: u64) -> PyResult<bool> {
    match token.extract::<i128>() {
        Ok(token) => Ok(token >= horizon as i128),
        Err(_) => token.ge(horizon),
    }
}

#[pyclass(module = "partition_server._native", name = "TxnGuard")]
pub struct TxnGuard {
    #[pyo3(get)]
    max_cached: i64,
    #[pyo3(get)]
    max_ended: i64,
    generation: u64,
    horizon: u64,
    // The cache in least-recently-used order: a stamp per use, and the entries.
    cache: HashMap<Key, (u64, PyObject)>,
    cache_order: BTreeMap<u64, Key>,
    cache_next: u64,
    // txn key -> generation of its last marker here; its order, oldest first (a place
    // whose generation no longer matches was ended again since: skipped).
    ended: HashMap<Key, u64>,
    ended_order: VecDeque<(Key, u64)>,
}

impl TxnGuard {
    fn touch(&mut self, key: Key) {
        let stamp = self.cache_next;
        self.cache_next += 1;
        if let Some(entry) = self.cache.get_mut(&key) {
            self.cache_order.remove(&entry.0);
            entry.0 = stamp;
            self.cache_order.insert(stamp, key);
        }
    }

    fn uncache(&mut self, key: Key) {
        if let Some((stamp, _)) = self.cache.remove(&key) {
            self.cache_order.remove(&stamp);
        }
    }

    /// allows, by key, for a token that is a u64 or not (`None`: an int the guard's
    /// generations never reach, so at least the horizon when non-negative).
    pub(crate) fn allows_key(&self, key: Key, token: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(!self.ended.contains_key(&key) && token_at_least(token, self.horizon)?)
    }

    /// on_marker, by key.
    pub(crate) fn on_marker_key(&mut self, key: Key) {
        self.uncache(key);
        self.ended.insert(key, self.generation);
        self.ended_order.push_back((key, self.generation));
        self.generation += 1;
        while self.ended.len() as i64 > self.max_ended {
            let (oldest, generation) = self.ended_order.pop_front().expect("an ended place");
            if self.ended.get(&oldest) == Some(&generation) {
                self.ended.remove(&oldest);
                self.horizon = self.horizon.max(generation + 1);
            }
        }
        if self.ended_order.len() > 2 * self.ended.len() + 64 {
            let ended = &self.ended;
            self.ended_order.retain(|(key, generation)| ended.get(key) == Some(generation));
        }
    }
}

#[pymethods]
impl TxnGuard {
    #[new]
    #[pyo3(signature = (max_cached = DEFAULT_MAX_CACHED, max_ended = DEFAULT_MAX_ENDED))]
    fn new(py: Python<'_>, max_cached: i64, max_ended: i64) -> PyResult<Self> {
        if !(max_cached >= 1 && max_ended >= 1) {
            let args = PyTuple::new(py, [PyTuple::new(py, [max_cached, max_ended])?])?;
            return Err(PyErr::from_type(py.get_type::<PyAssertionError>(), args.unbind()));
        }
        Ok(TxnGuard {
            max_cached,
            max_ended,
            generation: 0,
            horizon: 0,
            cache: HashMap::new(),
            cache_order: BTreeMap::new(),
            cache_next: 0,
            ended: HashMap::new(),
            ended_order: VecDeque::new(),
        })
    }

    #[getter]
    fn generation(&self) -> u64 {
        self.generation
    }

    #[getter]
    fn horizon(&self) -> u64 {
        self.horizon
    }

    #[getter]
    fn cached_count(&self) -> usize {
        self.cache.len()
    }

    /// Take before asking the coordinator.
    fn token(&self) -> u64 {
        self.generation
    }

    /// A still-usable verification of txn on this partition, or None.
    fn cached(&mut self, py: Python<'_>, txn: &Bound<'_, PyAny>) -> PyResult<Option<PyObject>> {
        let key = txn_key(txn)?;
        let entry = match self.cache.get(&key) {
            Some((_, entry)) => entry.clone_ref(py),
            None => return Ok(None),
        };
        let token = entry.bind(py).getattr(pyo3::intern!(py, "token"))?;
        if !self.allows_key(key, &token)? {
            self.uncache(key);
            return Ok(None);
        }
        self.touch(key);
        Ok(Some(entry))
    }

    /// Cache a positive answer obtained with `token`; False (and nothing cached) when a
    /// marker for txn came meanwhile or the token fell below the horizon.
    #[pyo3(signature = (txn, token, session, opener = None))]
    fn remember(&mut self, py: Python<'_>, txn: &Bound<'_, PyAny>, token: &Bound<'_, PyAny>,
                session: &Bound<'_, PyAny>, opener: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let key = txn_key(txn)?;
        if !self.allows_key(key, token)? {
            return Ok(false);
        }
        let verified = match opener {
            Some(opener) => verified_type(py)?.call1(py, (token, session, opener))?,
            None => verified_type(py)?.call1(py, (token, session))?,
        };
        self.uncache(key);
        let stamp = self.cache_next;
        self.cache_next += 1;
        self.cache.insert(key, (stamp, verified));
        self.cache_order.insert(stamp, key);
        while self.cache.len() as i64 > self.max_cached {
            // (BTreeMap::pop_first is newer than Rust 1.63)
            let (stamp, oldest) = match self.cache_order.iter().next() {
                Some((stamp, key)) => (*stamp, *key),
                None => break,
            };
            self.cache_order.remove(&stamp);
            self.cache.remove(&oldest);
        }
        Ok(true)
    }

    /// May a write verified with `token` be appended now?
    fn allows(&self, txn: &Bound<'_, PyAny>, token: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.allows_key(txn_key(txn)?, token)
    }

    /// A marker for txn was applied here (written or not).
    pub(crate) fn on_marker(&mut self, txn: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = txn_key(txn)?;
        self.on_marker_key(key);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("TxnGuard(generation={}, horizon={}, cached={}, ended={})",
                self.generation, self.horizon, self.cache.len(), self.ended.len())
    }
}
