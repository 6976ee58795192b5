//! Arguments from Python: keys, block and slot ids, named choices,
//! seconds, group ids.

use super::*;

pub(crate) fn parse_keys(py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<BlockKey>> {
    let mut out = Vec::new();
    for k in keys.try_iter()? {
        let k = k?;
        let hash_of = |h: &Bound<'_, PyAny>| -> PyResult<u64> {
            if let Ok(v) = h.extract::<u64>() {
                return Ok(v);
            }
            // Negative hashes (Python's hash()) fold to their 64-bit pattern.
            h.extract::<i64>()
                .map(|v| v as u64)
                .map_err(|_| errors::options(py, format!("a block hash must be an int in [-2**63, 2**64), not {k}")))
        };
        if let Ok(t) = k.cast::<PyTuple>() {
            if t.len() != 2 {
                return Err(errors::options(py, format!("a key is an int or a (hash, group) pair, not {k}")));
            }
            let group = t
                .get_item(1)?
                .extract::<u32>()
                .map_err(|_| errors::options(py, format!("a key's group must be an int in [0, 2**32), not {k}")))?;
            out.push(BlockKey::new(hash_of(&t.get_item(0)?)?, group));
        } else {
            out.push(BlockKey::new(hash_of(&k)?, 0));
        }
    }
    Ok(out)
}

pub(crate) fn parse_blocks(py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    parse_ids(py, "a GPU block id", blocks)
}

/// A list of non-negative ints: any iterable of ints, or an array with
/// `tolist()` (numpy, as vLLM's specs hold them), converted in one call.
pub(crate) fn parse_ids(py: Python<'_>, what: &str, ids: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    if let Ok(list) = ids.call_method0("tolist") {
        if let Ok(v) = list.extract::<Vec<usize>>() {
            return Ok(v);
        }
    }
    let mut out = Vec::new();
    for b in ids.try_iter()? {
        let b = b?;
        out.push(
            b.extract::<usize>()
                .map_err(|_| errors::options(py, format!("{what} must be a non-negative int, not {b}")))?,
        );
    }
    Ok(out)
}

/// `given` looked up in `table`, for choices no library enum names (the
/// sim hooks' capture modes, spelled as Python spells them).
pub(crate) fn choice<T: Copy>(py: Python<'_>, what: &str, given: &str, table: &[(&str, T)]) -> PyResult<T> {
    table.iter().find(|(n, _)| *n == given).map(|(_, v)| *v).ok_or_else(|| {
        let names: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
        errors::options(py, format!("{what} must be one of {names:?}, not {given:?}"))
    })
}

/// `given` as a value of `T`, by `T`'s one table of names (`kvoffload::names`).
pub(crate) fn named<T: Named>(py: Python<'_>, what: &str, given: &str) -> PyResult<T> {
    T::from_name(given).map_err(|e| errors::options(py, format!("{what} must be one of {:?}, not {given:?}", e.valid)))
}

pub(crate) fn seconds(py: Python<'_>, what: &str, s: Option<f64>) -> PyResult<Option<Duration>> {
    match s {
        None => Ok(None),
        Some(v) if v.is_finite() && v >= 0.0 => Duration::try_from_secs_f64(v).map(Some).map_err(|_| {
            errors::options(py, format!("{what} must be a non-negative number of seconds or None, not {v} (too large)"))
        }),
        Some(v) => {
            Err(errors::options(py, format!("{what} must be a non-negative number of seconds or None, not {v}")))
        }
    }
}

/// `allow_group`: a gid (int) or a group name (looked up with Python's
/// `grp` module).
pub(crate) fn group_id(py: Python<'_>, g: &Bound<'_, PyAny>) -> PyResult<u32> {
    if let Ok(gid) = g.extract::<u32>() {
        return Ok(gid);
    }
    let Ok(name) = g.extract::<String>() else {
        return Err(errors::options(py, format!("allow_group must be a gid (int) or a group name (str), not {g}")));
    };
    let entry = py
        .import("grp")?
        .call_method1("getgrnam", (name.as_str(),))
        .map_err(|_| errors::options(py, format!("allow_group: no group named {name:?}")))?;
    entry.getattr("gr_gid")?.extract::<u32>()
}
