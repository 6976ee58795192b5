//! The abstract GPU runtime.
