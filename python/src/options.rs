//! The option objects of `kvoffload.Offloader` and `KeyedOffloader`, one
//! class per Rust options type, with that type's name and field names
//! (issue 30, item 2; the KV cache's two, `KvSpec` and `KvAlloc`, are
//! built here with the same checker but live in tensors.rs, beside the
//! reading of the tensors):
//!
//! | Python | Rust | fields |
//! |---|---|---|
//! | `KvSpec` | `offloader::KvSpec` | `tensors` (the tensor objects; Rust's `TensorSpec`s once read), `gpu_blocks`, `page_bytes` (Python's: one for all, or each tensor's size over `gpu_blocks`), `block_factor`, `compute_stream` (its handle) |
//! | `KvAlloc` | `offloader::KvAlloc` | `tensors`, `page_bytes`, `gpu_blocks`, `block_factor` |
//! | `PinOptions` | `pin::PinOptions` | `threads`, `max_chunk_bytes`, `prefault`, `huge_pages`, `lookahead_bytes`, `huge_fallback_mbps`, `prefault_nice`, `policy` |
//! | `TransferOptions` | `transfer::TransferOptions` | `backend`, `staging_bytes`, `duplex_linger` (Rust's `thresholds.duplex_linger`), `expedited_lane` |
//! | `RegionSpec` | `offloader::RegionSpec` | `anonymous()`, `shared(name, rank, ranks, options)` |
//! | `ShmOptions` | `region::ShmOptions` | `dir`, `timeout`, `check_memory`, `allow_group` |
//!
//! Each is immutable, built from keyword arguments only (a field left out
//! keeps Rust's default; None for a numeric field means that default too),
//! compares by value, and has `replace(**changes)` for a changed copy. Every
//! argument is checked when the object is built: a name that is no field,
//! or a value of the wrong type or out of range, raises `OptionsError`
//! (kind `"options"`; pinning's limits kind `"pin"`, as `Offloader` raised
//! them before). The enums are named by strings (`prefault="touch"`), the
//! tables below. `KvSpec` differs in two ways: its `tensors` may come by
//! position and hold Python objects (compared by identity; its `repr`
//! reads back with `eval` only when they are addresses), and what needs
//! the runtime (each tensor's device, contiguity and size) is checked when
//! the offloader reads them.

use std::path::PathBuf;
use std::time::Duration;

use kvoffload::internal::region::shm_path;
use kvoffload::{
    BackendChoice, CapturePolicy, HugePages, OffloaderError, PinOptions, PrefaultMode, RegionSpec, ShmOptions,
    TransferOptions, DEFAULT_SHM_DIR, MAX_RANKS,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString, PyTuple};

use crate::args::{group_id, seconds};
use crate::errors;
use crate::signals::Signals;
use kvoffload::Named;

/// The arguments of an option class's constructor (or `replace`), checked
/// against its fields: `positional` of them may come first by position,
/// every other one by keyword; anything else is an `OptionsError` naming
/// the class and its fields.
pub(crate) fn arguments<'py>(
    py: Python<'py>,
    class: &str,
    fields: &'static [&'static str],
    positional: usize,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<Vec<(&'static str, Bound<'py, PyAny>)>> {
    let field = |name: &str| -> PyResult<&'static str> {
        fields.iter().find(|f| **f == name).copied().ok_or_else(|| {
            errors::options(py, format!("{class} has no field {name:?}; its fields are {}", fields.join(", ")))
        })
    };
    if args.len() > positional {
        let takes = if positional == 0 {
            "keyword arguments only".to_string()
        } else {
            format!("at most {positional} positional argument(s) ({})", fields[..positional].join(", "))
        };
        return Err(errors::options(py, format!("{class} takes {takes}, {} given", args.len())));
    }
    let mut out: Vec<(&'static str, Bound<'py, PyAny>)> = Vec::new();
    for (i, a) in args.iter().enumerate() {
        out.push((fields[i], a));
    }
    if let Some(kw) = kwargs {
        for (k, v) in kw.iter() {
            let name: String = k.extract()?;
            let f = field(&name)?;
            if out.iter().any(|(n, _)| *n == f) {
                return Err(errors::options(py, format!("{class}: {f} given twice")));
            }
            out.push((f, v));
        }
    }
    Ok(out)
}

const PIN_FIELDS: &[&str] = &[
    "threads",
    "max_chunk_bytes",
    "prefault",
    "huge_pages",
    "lookahead_bytes",
    "huge_fallback_mbps",
    "prefault_nice",
    "policy",
];
const TRANSFER_FIELDS: &[&str] = &["backend", "staging_bytes", "duplex_linger", "expedited_lane"];
const SHM_FIELDS: &[&str] = &["dir", "timeout", "check_memory", "allow_group"];
const SHARED_FIELDS: &[&str] = &["name", "rank", "ranks", "options"];

/// A short description of `v`'s value and type for messages.
pub(crate) fn shown(v: &Bound<'_, PyAny>) -> String {
    let ty = v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    match v.repr() {
        Ok(r) => format!("{r} ({ty})"),
        Err(_) => ty,
    }
}

/// An int (never a bool) converted to `T`; `what` says the range.
pub(crate) fn int<'py, T: FromPyObjectOwned<'py>>(
    py: Python<'py>,
    class: &str,
    field: &str,
    what: &str,
    v: &Bound<'py, PyAny>,
) -> PyResult<T> {
    let bad = || errors::options(py, format!("{class}.{field} must be {what}, not {}", shown(v)));
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
        return Err(bad());
    }
    v.extract::<T>().map_err(|_| bad())
}

/// As [`int`], None giving `None`.
pub(crate) fn opt_int<'py, T: FromPyObjectOwned<'py>>(
    py: Python<'py>,
    class: &str,
    field: &str,
    what: &str,
    v: &Bound<'py, PyAny>,
) -> PyResult<Option<T>> {
    if v.is_none() {
        return Ok(None);
    }
    int(py, class, field, &format!("{what} or None"), v).map(Some)
}

fn boolean(py: Python<'_>, class: &str, field: &str, v: &Bound<'_, PyAny>) -> PyResult<bool> {
    if !v.is_instance_of::<PyBool>() {
        return Err(errors::options(py, format!("{class}.{field} must be a bool, not {}", shown(v))));
    }
    v.extract()
}

/// A string naming a value of `T`, by `T`'s one table of names
/// (`kvoffload::Named`).
fn named<T: Named>(py: Python<'_>, class: &str, field: &str, v: &Bound<'_, PyAny>) -> PyResult<T> {
    let Ok(s) = v.cast::<PyString>() else {
        return Err(errors::options(py, format!("{class}.{field} must be one of {:?}, not {}", T::names(), shown(v))));
    };
    crate::args::named(py, &format!("{class}.{field}"), &s.to_cow()?)
}

/// A number of seconds (int or float, not negative).
fn secs(py: Python<'_>, class: &str, field: &str, v: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let what = format!("{class}.{field}");
    if v.is_instance_of::<PyBool>() || !(v.is_instance_of::<PyInt>() || v.is_instance_of::<PyFloat>()) {
        return Err(errors::options(py, format!("{what} must be a non-negative number of seconds, not {}", shown(v))));
    }
    Ok(seconds(py, &what, Some(v.extract::<f64>()?))?.unwrap_or_default())
}

/// `s` as a Python string literal (single quotes), so that `repr` reads
/// back with `eval`.
fn quoted(s: &str) -> String {
    let mut out = String::from("'");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// Pinning: `kvoffload.PinOptions`, Rust's `PinOptions` (the fields Python
/// sets; `numa` and `numa_sysfs_root` keep Rust's defaults).
#[pyclass(name = "PinOptions", module = "kvoffload", frozen, eq)]
#[derive(Clone, PartialEq, Default)]
pub(crate) struct PyPinOptions {
    pub(crate) o: PinOptions,
}

impl PyPinOptions {
    fn apply(
        mut o: PinOptions,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        const C: &str = "PinOptions";
        let d = PinOptions::default();
        for (f, v) in arguments(py, C, PIN_FIELDS, 0, args, kwargs)? {
            match f {
                "threads" => o.threads = opt_int(py, C, f, "an int >= 1", &v)?.unwrap_or(d.threads),
                "max_chunk_bytes" => {
                    o.max_chunk_bytes = opt_int(py, C, f, "an int >= 1", &v)?.unwrap_or(d.max_chunk_bytes)
                }
                "prefault" => o.prefault = named::<PrefaultMode>(py, C, f, &v)?,
                "huge_pages" => o.huge_pages = named::<HugePages>(py, C, f, &v)?,
                "lookahead_bytes" => {
                    o.lookahead_bytes = opt_int(py, C, f, "an int >= 0", &v)?.unwrap_or(d.lookahead_bytes)
                }
                "huge_fallback_mbps" => {
                    o.huge_fallback_mbps =
                        opt_int(py, C, f, "an int in [0, 2**32)", &v)?.unwrap_or(d.huge_fallback_mbps)
                }
                "prefault_nice" => {
                    o.prefault_nice = opt_int(py, C, f, "an int from 0 to 19", &v)?.unwrap_or(d.prefault_nice)
                }
                "policy" => o.policy = named::<CapturePolicy>(py, C, f, &v)?,
                _ => unreachable!("PIN_FIELDS"),
            }
        }
        // Rust's limits, raised as the offloader raised them (kind "pin").
        o.validate().map_err(|e| errors::offloader(py, OffloaderError::Pin(e)))?;
        Ok(PyPinOptions { o })
    }
}

#[pymethods]
impl PyPinOptions {
    #[new]
    #[pyo3(signature = (*args, **kwargs))]
    fn new(py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::apply(PinOptions::default(), py, args, kwargs)
    }

    /// A copy with the given fields changed (checked as the constructor
    /// checks them).
    #[pyo3(signature = (*args, **kwargs))]
    fn replace(&self, py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::apply(self.o.clone(), py, args, kwargs)
    }

    /// Pre-fault threads (default: three in four of the cores).
    #[getter]
    fn threads(&self) -> usize {
        self.o.threads
    }

    /// Bytes of one registration call (default 256 MiB).
    #[getter]
    fn max_chunk_bytes(&self) -> usize {
        self.o.max_chunk_bytes
    }

    /// `"populate"`, `"touch"` or `"off"`.
    #[getter]
    fn prefault(&self) -> &'static str {
        self.o.prefault.name()
    }

    /// `"auto"`, `"on"` or `"off"`.
    #[getter]
    fn huge_pages(&self) -> &'static str {
        self.o.huge_pages.name()
    }

    /// Bytes pre-faulted ahead of the chunk being registered; None: the
    /// whole region (the default).
    #[getter]
    fn lookahead_bytes(&self) -> Option<usize> {
        (self.o.lookahead_bytes != usize::MAX).then_some(self.o.lookahead_bytes)
    }

    /// MB/s per thread below which huge pages give way (default 1000; 0:
    /// never).
    #[getter]
    fn huge_fallback_mbps(&self) -> u32 {
        self.o.huge_fallback_mbps
    }

    /// The pre-fault threads' niceness (default 10).
    #[getter]
    fn prefault_nice(&self) -> i32 {
        self.o.prefault_nice
    }

    /// When capture windows may open while pinning runs: `"after_pinning"`
    /// or `"interleave"`.
    #[getter]
    fn policy(&self) -> &'static str {
        self.o.policy.name()
    }

    fn __repr__(&self) -> String {
        let look = self.lookahead_bytes().map_or("None".to_string(), |b| b.to_string());
        format!(
            "kvoffload.PinOptions(threads={}, max_chunk_bytes={}, prefault={}, huge_pages={}, lookahead_bytes={look}, \
             huge_fallback_mbps={}, prefault_nice={}, policy={})",
            self.o.threads,
            self.o.max_chunk_bytes,
            quoted(self.prefault()),
            quoted(self.huge_pages()),
            self.o.huge_fallback_mbps,
            self.o.prefault_nice,
            quoted(self.policy()),
        )
    }
}

/// Copies: `kvoffload.TransferOptions`, Rust's `TransferOptions` (the
/// fields Python sets; `duplex_linger` is Rust's
/// `thresholds.duplex_linger`).
#[pyclass(name = "TransferOptions", module = "kvoffload", frozen, eq)]
#[derive(Clone, PartialEq, Default)]
pub(crate) struct PyTransferOptions {
    pub(crate) o: TransferOptions,
}

impl PyTransferOptions {
    fn apply(
        mut o: TransferOptions,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        const C: &str = "TransferOptions";
        let d = TransferOptions::default();
        for (f, v) in arguments(py, C, TRANSFER_FIELDS, 0, args, kwargs)? {
            match f {
                "backend" => o.backend = named::<BackendChoice>(py, C, f, &v)?,
                "staging_bytes" => o.staging_bytes = opt_int(py, C, f, "an int >= 0", &v)?.unwrap_or(d.staging_bytes),
                "duplex_linger" => {
                    o.thresholds.duplex_linger =
                        if v.is_none() { d.thresholds.duplex_linger } else { secs(py, C, f, &v)? }
                }
                "expedited_lane" => o.expedited_lane = boolean(py, C, f, &v)?,
                _ => unreachable!("TRANSFER_FIELDS"),
            }
        }
        Ok(PyTransferOptions { o })
    }
}

#[pymethods]
impl PyTransferOptions {
    #[new]
    #[pyo3(signature = (*args, **kwargs))]
    fn new(py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::apply(TransferOptions::default(), py, args, kwargs)
    }

    /// A copy with the given fields changed.
    #[pyo3(signature = (*args, **kwargs))]
    fn replace(&self, py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::apply(self.o, py, args, kwargs)
    }

    /// `"auto"`, `"per-fragment"`, `"batched"`, `"gather"` or `"staged"`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.o.backend.name()
    }

    /// Device staging bytes per direction (default 32 MiB; 0: no staged
    /// backend).
    #[getter]
    fn staging_bytes(&self) -> usize {
        self.o.staging_bytes
    }

    /// Seconds the other direction counts as busy after its last job.
    #[getter]
    fn duplex_linger(&self) -> f64 {
        self.o.thresholds.duplex_linger.as_secs_f64()
    }

    /// A third lane for expedited loads.
    #[getter]
    fn expedited_lane(&self) -> bool {
        self.o.expedited_lane
    }

    fn __repr__(&self) -> String {
        format!(
            "kvoffload.TransferOptions(backend={}, staging_bytes={}, duplex_linger={:?}, expedited_lane={})",
            quoted(self.backend()),
            self.o.staging_bytes,
            self.duplex_linger(),
            if self.o.expedited_lane { "True" } else { "False" },
        )
    }
}

/// A shared region's options: `kvoffload.ShmOptions`, Rust's `ShmOptions`
/// (the fields Python sets). `allow_group` is kept as a gid (a group name
/// is looked up when the options are built).
#[pyclass(name = "ShmOptions", module = "kvoffload", frozen, eq)]
#[derive(Clone, PartialEq)]
pub(crate) struct PyShmOptions {
    pub(crate) dir: PathBuf,
    pub(crate) timeout: Duration,
    pub(crate) check_memory: bool,
    pub(crate) allow_group: Option<u32>,
}

impl Default for PyShmOptions {
    fn default() -> Self {
        PyShmOptions {
            dir: PathBuf::from(DEFAULT_SHM_DIR),
            timeout: Duration::from_secs(60),
            check_memory: true,
            allow_group: None,
        }
    }
}

impl PyShmOptions {
    fn apply(
        mut self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        const C: &str = "ShmOptions";
        for (f, v) in arguments(py, C, SHM_FIELDS, 0, args, kwargs)? {
            match f {
                "dir" => {
                    self.dir = if v.is_none() {
                        PathBuf::from(DEFAULT_SHM_DIR)
                    } else {
                        v.extract::<PathBuf>().map_err(|_| {
                            errors::options(
                                py,
                                format!("{C}.dir must be a path (str or os.PathLike), not {}", shown(&v)),
                            )
                        })?
                    }
                }
                "timeout" => self.timeout = secs(py, C, f, &v)?,
                "check_memory" => self.check_memory = boolean(py, C, f, &v)?,
                "allow_group" => {
                    self.allow_group = if v.is_none() {
                        None
                    } else if v.is_instance_of::<PyBool>() {
                        return Err(errors::options(
                            py,
                            format!("{C}.allow_group must be a gid (int) or a group name (str), not {}", shown(&v)),
                        ));
                    } else {
                        Some(group_id(py, &v)?)
                    }
                }
                _ => unreachable!("SHM_FIELDS"),
            }
        }
        Ok(self)
    }

    /// The Rust options, their waits stopped by Ctrl-C through `signals`.
    pub(crate) fn build(&self, signals: &Signals) -> ShmOptions {
        let check = signals.clone();
        let mut o = ShmOptions::new()
            .dir(&self.dir)
            .timeout(self.timeout)
            .check_memory(self.check_memory)
            .interrupt(move || check.check());
        if let Some(g) = self.allow_group {
            o = o.allow_group(g);
        }
        o
    }
}

#[pymethods]
impl PyShmOptions {
    #[new]
    #[pyo3(signature = (*args, **kwargs))]
    fn new(py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        PyShmOptions::default().apply(py, args, kwargs)
    }

    /// A copy with the given fields changed.
    #[pyo3(signature = (*args, **kwargs))]
    fn replace(&self, py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        self.clone().apply(py, args, kwargs)
    }

    /// Directory of the region's files (default `/dev/shm`).
    #[getter]
    fn dir(&self) -> String {
        self.dir.display().to_string()
    }

    /// Seconds creating or joining may wait for the other ranks.
    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    /// Whether the region (a joiner: its share) is checked against the
    /// memory this process can get.
    #[getter]
    fn check_memory(&self) -> bool {
        self.check_memory
    }

    /// The gid whose members' ranks may share the region, or None.
    #[getter]
    fn allow_group(&self) -> Option<u32> {
        self.allow_group
    }

    fn __repr__(&self) -> String {
        format!(
            "kvoffload.ShmOptions(dir={}, timeout={:?}, check_memory={}, allow_group={})",
            quoted(&self.dir()),
            self.timeout(),
            if self.check_memory { "True" } else { "False" },
            self.allow_group.map_or("None".to_string(), |g| g.to_string()),
        )
    }
}

/// Where the host blocks live: `kvoffload.RegionSpec`, Rust's `RegionSpec`:
/// `RegionSpec.anonymous()` (also `RegionSpec()`, the default),
/// `RegionSpec.shared(name, rank=0, ranks=1, options=ShmOptions())` or
/// `RegionSpec.persistent(...)` (the same arguments: a node pool's rows).
#[pyclass(name = "RegionSpec", module = "kvoffload", frozen, eq)]
#[derive(Clone, PartialEq, Default)]
pub(crate) struct PyRegionSpec {
    /// `None`: anonymous.
    pub(crate) shared: Option<Shared>,
}

/// `RegionSpec::Shared`'s and `RegionSpec::Persistent`'s fields.
#[derive(Clone, PartialEq)]
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) rank: usize,
    pub(crate) ranks: usize,
    pub(crate) options: PyShmOptions,
    /// `RegionSpec::Persistent`: kept across launches, never unlinked.
    pub(crate) persistent: bool,
}

impl PyRegionSpec {
    fn parse(
        py: Python<'_>,
        class: &'static str,
        persistent: bool,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let mut s = Shared { name: String::new(), rank: 0, ranks: 1, options: PyShmOptions::default(), persistent };
        let mut named = false;
        for (f, v) in arguments(py, class, SHARED_FIELDS, 1, args, kwargs)? {
            match f {
                "name" => {
                    s.name = v
                        .cast::<PyString>()
                        .map(|n| n.to_string())
                        .map_err(|_| errors::options(py, format!("{class}: name must be a str, not {}", shown(&v))))?;
                    named = true;
                }
                "rank" => s.rank = int(py, class, f, "an int >= 0", &v)?,
                "ranks" => s.ranks = int(py, class, f, &format!("an int in [1, {MAX_RANKS}]"), &v)?,
                "options" => {
                    s.options = if v.is_none() {
                        PyShmOptions::default()
                    } else {
                        v.cast::<PyShmOptions>()
                            .map_err(|_| {
                                errors::options(
                                    py,
                                    format!("{class}: options must be a kvoffload.ShmOptions, not {}", shown(&v)),
                                )
                            })?
                            .get()
                            .clone()
                    }
                }
                _ => unreachable!("SHARED_FIELDS"),
            }
        }
        if !named {
            return Err(errors::options(py, format!("{class} needs a name")));
        }
        // What the region checks when it is made, checked here (issue 43):
        // the name is one file name, the rank one of the ranks.
        if let Err(e) = shm_path(std::path::Path::new(DEFAULT_SHM_DIR), &s.name) {
            return Err(errors::options(py, format!("{class}.name must be a file name: {e}")));
        }
        if s.ranks == 0 || s.ranks > MAX_RANKS {
            return Err(errors::options(
                py,
                format!(
                    "{class}.ranks must be an int in [1, {MAX_RANKS}] (the most ranks a region's header holds), not {}",
                    s.ranks
                ),
            ));
        }
        if s.rank >= s.ranks {
            return Err(errors::options(
                py,
                format!(
                    "{class}.rank must be below ranks ({}): the ranks are 0..{}, not {}",
                    s.ranks,
                    s.ranks - 1,
                    s.rank
                ),
            ));
        }
        Ok(PyRegionSpec { shared: Some(s) })
    }

    /// The Rust region spec (shared regions' waits stopped by Ctrl-C
    /// through `signals`).
    pub(crate) fn build(&self, signals: &Signals) -> RegionSpec {
        match &self.shared {
            None => RegionSpec::Anonymous,
            Some(s) if s.persistent => RegionSpec::Persistent {
                name: s.name.clone(),
                rank: s.rank,
                ranks: s.ranks,
                options: s.options.build(signals),
            },
            Some(s) => RegionSpec::Shared {
                name: s.name.clone(),
                rank: s.rank,
                ranks: s.ranks,
                options: s.options.build(signals),
            },
        }
    }
}

#[pymethods]
impl PyRegionSpec {
    /// `RegionSpec()`: an anonymous region (the default).
    #[new]
    fn new() -> Self {
        PyRegionSpec { shared: None }
    }

    /// Private memory of this process (one rank).
    #[staticmethod]
    fn anonymous() -> Self {
        PyRegionSpec { shared: None }
    }

    /// A region shared by the `ranks` processes of one node: a file named
    /// after `name` in `options.dir`, created by rank 0 and joined by the
    /// others.
    #[staticmethod]
    #[pyo3(signature = (*args, **kwargs))]
    fn shared(py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::parse(py, "RegionSpec.shared", false, args, kwargs)
    }

    /// The rows of a node pool: a region of `name` in `options.dir` shared
    /// by the engines of a node across launches, created by the first
    /// process to come (whatever its rank), opened by every later one,
    /// never unlinked by an offloader (`kvoffload pool rm` removes it).
    /// More than one rank needs the offloader's `agreement` transport.
    #[staticmethod]
    #[pyo3(signature = (*args, **kwargs))]
    fn persistent(py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::parse(py, "RegionSpec.persistent", true, args, kwargs)
    }

    /// `"anonymous"`, `"shared"` or `"persistent"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match &self.shared {
            None => "anonymous",
            Some(s) if s.persistent => "persistent",
            Some(_) => "shared",
        }
    }

    /// The shared region's name (None: anonymous).
    #[getter]
    fn name(&self) -> Option<String> {
        self.shared.as_ref().map(|s| s.name.clone())
    }

    /// This process's rank (0 for an anonymous region).
    #[getter]
    fn rank(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.rank)
    }

    /// Ranks sharing the region (1 for an anonymous region).
    #[getter]
    fn ranks(&self) -> usize {
        self.shared.as_ref().map_or(1, |s| s.ranks)
    }

    /// The shared region's options (None: anonymous).
    #[getter]
    fn options(&self) -> Option<PyShmOptions> {
        self.shared.as_ref().map(|s| s.options.clone())
    }

    fn __repr__(&self) -> String {
        match &self.shared {
            None => "kvoffload.RegionSpec.anonymous()".to_string(),
            Some(s) => format!(
                "kvoffload.RegionSpec.{}({}, rank={}, ranks={}, options={})",
                if s.persistent { "persistent" } else { "shared" },
                quoted(&s.name),
                s.rank,
                s.ranks,
                s.options.__repr__()
            ),
        }
    }
}

/// An option object given to `Offloader` as `arg=`: None gives the
/// defaults; anything but a `T` is an `OptionsError`.
pub(crate) fn given<'py, T>(py: Python<'py>, arg: &str, class: &str, v: Option<&Bound<'py, PyAny>>) -> PyResult<T>
where
    T: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync + Clone + Default,
{
    match v {
        None => Ok(T::default()),
        Some(v) if v.is_none() => Ok(T::default()),
        Some(v) => v
            .cast::<T>()
            .map(|b| b.get().clone())
            .map_err(|_| errors::options(py, format!("{arg} must be a kvoffload.{class}, not {}", shown(v)))),
    }
}

/// The keyword arguments `Offloader` took before issue 30 (`addressing=`
/// gave way to the two classes), each with where
/// it went, so that an old call fails with directions.
const MOVED: &[(&str, &str)] = &[
    ("addressing", "the class: kvoffload.KeyedOffloader for keys, kvoffload.Offloader for slots"),
    (
        "tensors",
        "kv=kvoffload.KvSpec(tensors, ...) for the engine's tensors, kv=kvoffload.KvAlloc(tensors=<count>, ...) to \
         allocate them",
    ),
    ("gpu_blocks", "kv=kvoffload.KvSpec(..., gpu_blocks=...) or kvoffload.KvAlloc(..., gpu_blocks=...)"),
    ("page_bytes", "kv=kvoffload.KvSpec(..., page_bytes=...) or kvoffload.KvAlloc(..., page_bytes=...)"),
    ("block_factor", "kv=kvoffload.KvSpec(..., block_factor=...) or kvoffload.KvAlloc(..., block_factor=...)"),
    ("stream", "kv=kvoffload.KvSpec(..., compute_stream=...)"),
    ("backend", "runtime=kvoffload.Runtime(backend, device)"),
    ("device", "runtime=kvoffload.Runtime(backend, device)"),
    ("name", "region=kvoffload.RegionSpec.shared(name, ...)"),
    ("rank", "region=kvoffload.RegionSpec.shared(name, rank=...)"),
    ("ranks", "region=kvoffload.RegionSpec.shared(name, ranks=...)"),
    ("region_dir", "region=kvoffload.RegionSpec.shared(name, options=kvoffload.ShmOptions(dir=...))"),
    ("join_timeout", "region=kvoffload.RegionSpec.shared(name, options=kvoffload.ShmOptions(timeout=...))"),
    ("allow_group", "region=kvoffload.RegionSpec.shared(name, options=kvoffload.ShmOptions(allow_group=...))"),
    ("check_memory", "region=kvoffload.RegionSpec.shared(name, options=kvoffload.ShmOptions(check_memory=...))"),
    ("pin_threads", "pin=kvoffload.PinOptions(threads=...)"),
    ("max_chunk_bytes", "pin=kvoffload.PinOptions(max_chunk_bytes=...)"),
    ("prefault", "pin=kvoffload.PinOptions(prefault=...)"),
    ("huge_pages", "pin=kvoffload.PinOptions(huge_pages=...)"),
    ("pin_lookahead_bytes", "pin=kvoffload.PinOptions(lookahead_bytes=...)"),
    ("huge_fallback_mbps", "pin=kvoffload.PinOptions(huge_fallback_mbps=...)"),
    ("pin_nice", "pin=kvoffload.PinOptions(prefault_nice=...)"),
    ("capture_policy", "pin=kvoffload.PinOptions(policy=...)"),
    ("copy_backend", "transfer=kvoffload.TransferOptions(backend=...)"),
    ("staging_bytes", "transfer=kvoffload.TransferOptions(staging_bytes=...)"),
    ("duplex_linger", "transfer=kvoffload.TransferOptions(duplex_linger=...)"),
    ("expedited_lane", "transfer=kvoffload.TransferOptions(expedited_lane=...)"),
];

/// The other class's own arguments, where each goes.
const KEYED_ONLY: &[(&str, &str)] =
    &[("eviction", "kvoffload.KeyedOffloader(eviction=...): the slot-addressed Offloader places no keys")];
const SLOTS_ONLY: &[(&str, &str)] =
    &[("kv_groups", "kvoffload.Offloader(kv_groups=...): a KeyedOffloader's jobs have one group")];

/// A constructor's keyword arguments beyond its own (`keyed`: of
/// `KeyedOffloader`): an `OptionsError` naming each (and where an old one,
/// or the other class's own, went).
pub(crate) fn unknown_arguments(py: Python<'_>, keyed: bool, unknown: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    let Some(kw) = unknown.filter(|k| !k.is_empty()) else { return Ok(()) };
    let (class, other) = if keyed { ("KeyedOffloader", SLOTS_ONLY) } else { ("Offloader", KEYED_ONLY) };
    let mut parts = Vec::new();
    for k in kw.keys() {
        let k: String = k.extract()?;
        match MOVED.iter().chain(other).find(|(old, _)| *old == k) {
            Some((_, new)) => parts.push(format!("{k} (now {new})")),
            None => parts.push(k),
        }
    }
    Err(errors::options(py, format!("{class} got unknown keyword arguments: {}", parts.join("; "))))
}
