//! `kvoffload.Runtime`: the GPU an offloader runs on.

use super::*;

/// The GPU an offloader runs on.
///
/// `Runtime("cuda", device=0)` opens the CUDA driver on `device` (its
/// primary context, the one PyTorch uses); `Runtime("sim")` is the
/// simulated GPU (tests, machines without a GPU); `Runtime("auto")` is the
/// CUDA driver where a device is visible, the simulated GPU otherwise. One
/// runtime can serve several offloaders.
#[pyclass(name = "Runtime", module = "kvoffload", frozen)]
pub(crate) struct PyRuntime {
    pub(crate) rt: Arc<dyn GpuRuntime>,
    pub(crate) cuda: Option<Arc<CudaRuntime>>,
    /// The CUDA device it was opened on (0 on the simulated GPU); an
    /// engine's tensors must be on it.
    pub(crate) device: usize,
}

impl PyRuntime {
    pub(crate) fn open(py: Python<'_>, backend: &str, device: usize) -> PyResult<PyRuntime> {
        let cuda = |py: Python<'_>| -> PyResult<PyRuntime> {
            let c = Arc::new(py.detach(|| CudaRuntime::open(device)).map_err(|e| errors::open(py, e))?);
            let rt: Arc<dyn GpuRuntime> = c.clone();
            Ok(PyRuntime { rt, cuda: Some(c), device })
        };
        let sim = || PyRuntime { rt: Arc::new(SimRuntime::new()), cuda: None, device: 0 };
        match backend {
            "sim" => Ok(sim()),
            "cuda" => cuda(py),
            "auto" => match CudaRuntime::device_count() {
                Ok(n) if n > 0 => cuda(py),
                _ => Ok(sim()),
            },
            other => Err(errors::options(py, format!("backend must be 'auto', 'sim' or 'cuda', not {other:?}"))),
        }
    }
}

#[pymethods]
impl PyRuntime {
    #[new]
    #[pyo3(signature = (backend = "auto", device = 0))]
    pub(crate) fn new(py: Python<'_>, backend: &str, device: usize) -> PyResult<Self> {
        PyRuntime::open(py, backend, device)
    }

    /// `"cuda"` or `"sim"`.
    #[getter]
    pub(crate) fn backend(&self) -> &'static str {
        self.rt.backend()
    }

    /// The CUDA device ordinal (0 on the simulated GPU).
    #[getter]
    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// The device and driver, for reports.
    pub(crate) fn describe(&self) -> String {
        self.rt.describe()
    }

    pub(crate) fn __repr__(&self) -> String {
        format!("kvoffload.Runtime({:?}: {})", self.rt.backend(), self.rt.describe())
    }
}
