//! Conformance scenarios for FACTS.md section 1.
