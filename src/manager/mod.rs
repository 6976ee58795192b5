//! Block manager: block states, reference counts and eviction (issue 6).
