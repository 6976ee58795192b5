//! The plain tests' time limit, shown failing (issue 29, item 4): the one
//! test here waits for ever, as a lost wake-up would make a library wait.
//! It is ignored in every normal run; `ci/test-limits --self-test` runs it
//! alone under nextest's `limit-self-test` profile (.config/nextest.toml)
//! and requires it to be killed and reported by name as TIMEOUT.

#[test]
#[ignore = "never ends: run only by ci/test-limits --self-test, which expects nextest to kill it"]
fn a_wait_that_never_ends_is_killed_and_named() {
    // A receiver whose sender lives on and never sends.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let _kept = tx;
    let _ = rx.recv();
    unreachable!("recv returned although its sender lives and never sent");
}
