//! Arguments of `kvoffload.Pool` from Python: the fingerprint's config
//! part, keys (vLLM's `OffloadKey`), the engine id's digest; and the
//! bounded, interruptible waits of the pool file.

use kvoffload::internal::pool::error::PoolError;
use kvoffload::internal::pool::file::Wait;
use kvoffload::internal::pool::fingerprint::{ConfigRecord, FixedStr, GroupRecord};
use kvoffload::internal::pool::words::Key;
use pyo3::types::PyBytes;

use super::*;

/// `config` (a dict with the fields of the fingerprint's config part,
/// design 1.3; `kvoffload.vllm.pool_config` makes it) as the record.
pub(crate) fn parse_config(py: Python<'_>, config: &Bound<'_, PyDict>) -> PyResult<ConfigRecord> {
    let field = |name: &str| -> PyResult<Bound<'_, PyAny>> {
        config
            .get_item(name)?
            .ok_or_else(|| errors::options(py, format!("Pool.open: config has no {name:?} (a fingerprint field)")))
    };
    let bad = |name: &str, want: &str| errors::options(py, format!("Pool.open: config[{name:?}] must be {want}"));
    let text = |name: &str| -> PyResult<String> { field(name)?.extract().map_err(|_| bad(name, "a str")) };
    let uint = |name: &str| -> PyResult<u32> { field(name)?.extract().map_err(|_| bad(name, "an int in [0, 2**32)")) };
    let pe = |e| errors::pool_file(py, e);
    let mut groups = Vec::new();
    for g in field("groups")?.try_iter()? {
        let (tokens_per_block, digest): (u32, Vec<u8>) =
            g?.extract().map_err(|_| bad("groups", "a list of (tokens_per_block, 32-byte SHA-256) pairs"))?;
        let layer_names_sha256: [u8; 32] =
            digest.try_into().map_err(|_| bad("groups", "a list of (tokens_per_block, 32-byte SHA-256) pairs"))?;
        groups.push(GroupRecord { tokens_per_block, layer_names_sha256 });
    }
    let record = ConfigRecord {
        model: FixedStr::new("model", &text("model")?).map_err(pe)?,
        kv_dtype: FixedStr::new("dtype", &text("kv_dtype")?).map_err(pe)?,
        tag: FixedStr::new("kvo_pool_tag", &text("tag")?).map_err(pe)?,
        groups,
        tokens_per_hash: uint("tokens_per_hash")?,
        blocks_per_chunk: uint("blocks_per_chunk")?,
        bytes_per_block: field("bytes_per_block")?.extract().map_err(|_| bad("bytes_per_block", "an int >= 0"))?,
        world_size: uint("world_size")?,
        tp_size: uint("tp_size")?,
        pp_size: uint("pp_size")?,
        pcp_size: uint("pcp_size")?,
        dcp_size: uint("dcp_size")?,
        kv_cache_layout: FixedStr::new("kv_cache_layout", &text("kv_cache_layout")?).map_err(pe)?,
        replicated_layout: field("replicated_layout")?.extract().map_err(|_| bad("replicated_layout", "a bool"))?,
    };
    record.check().map_err(pe)?;
    Ok(record)
}

/// A bounded wait of the pool file, interrupted by Python's signals: runs
/// `f` with the GIL released and the wait's check, then raises the signal
/// handler's exception if one was raised, else `f`'s error.
pub(crate) fn waiting<T: Send>(
    py: Python<'_>,
    timeout: f64,
    f: impl FnOnce(Wait<'_>) -> Result<T, PoolError> + Send,
) -> PyResult<T> {
    let bound = seconds(py, "timeout", Some(timeout))?.unwrap_or_default();
    let signals = Signals::default();
    let r = py.detach(|| {
        let check = || signals.check();
        f(Wait::new(bound).interruptible(&check))
    });
    if let Some(e) = signals.raised.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    r.map_err(|e| errors::pool_file(py, e))
}

/// vLLM's `OffloadKey` (hash bytes, then the group as 4 big-endian bytes)
/// as a pool key.
pub(crate) fn parse_key(py: Python<'_>, k: &Bound<'_, PyAny>) -> PyResult<Key> {
    let b = k.cast::<PyBytes>().map_err(|_| {
        errors::options(py, format!("a pool key is bytes (vLLM's OffloadKey: hash, then 4 group bytes), not {k}"))
    })?;
    let b = b.as_bytes();
    if b.len() < 5 || b.len() > 36 {
        return Err(errors::options(
            py,
            format!("a pool key is 1 to 32 hash bytes and 4 group bytes; this one has {} bytes", b.len()),
        ));
    }
    let (hash, group) = b.split_at(b.len() - 4);
    let group = u32::from_be_bytes([group[0], group[1], group[2], group[3]]);
    Key::new(hash, group).ok_or_else(|| errors::options(py, "a pool key's hash must have 1 to 32 bytes"))
}

pub(crate) fn key_bytes(k: &Key) -> Vec<u8> {
    let mut b = k.hash_bytes();
    b.extend_from_slice(&k.group.to_be_bytes());
    b
}

pub(crate) fn parse_keys_of(py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    keys.try_iter()?.map(|k| parse_key(py, &k?)).collect()
}

/// The SHA-256 of vLLM's `engine_id` as four words (design 2.4).
pub(crate) fn engine_digest(py: Python<'_>, engine_id: &str) -> PyResult<[u64; 4]> {
    let d = py.import("hashlib")?.call_method1("sha256", (PyBytes::new(py, engine_id.as_bytes()),))?;
    let d: Vec<u8> = d.call_method0("digest")?.extract()?;
    let mut w = [0u64; 4];
    for (i, c) in d.chunks(8).take(4).enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        w[i] = u64::from_le_bytes(b);
    }
    Ok(w)
}
