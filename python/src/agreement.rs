//! The ranks' agreement over a Python callable (`agreement=`).

use super::*;

/// The agreement transport backed by a Python callable: `f(mine) ->
/// list[int] | int` (an all-gather of every rank's word, or the result of
/// an all-reduce with MAX). Called once, on a thread of its own
/// (`kvo-agree-exchange`, which a shutdown does not wait for: see
/// `agree_via`), with the GIL taken for the call.
pub(crate) struct PyTransport {
    pub(crate) f: Py<PyAny>,
}

impl Transport for PyTransport {
    fn exchange(&self, mine: u32) -> Result<Vec<u32>, String> {
        Python::attach(|py| {
            let r = self.f.call1(py, (mine,)).map_err(|e| format!("the agreement callable raised {e}"))?;
            let r = r.bind(py);
            if let Ok(w) = r.extract::<u32>() {
                return Ok(vec![w]);
            }
            r.extract::<Vec<u32>>().map_err(|_| {
                let shown = r.repr().map(|s| s.to_string()).unwrap_or_else(|_| "?".into());
                format!("the agreement callable returned {shown}, not an int or a list of ints")
            })
        })
    }
}
