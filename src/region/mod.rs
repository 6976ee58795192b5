//! The host region: anonymous or /dev/shm shared mapping (issue 3).
