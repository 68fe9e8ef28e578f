//! Failures of work queued on a stream, kept until the next call on that stream reports them.
//!
//! Work this crate queues runs after the call that queued it has returned: a custom
//! operation that burn's fusion backend executes later, a kernel or GEMM graph launch and an
//! NCCL call that cubecl's device thread issues later. Such work cannot return its error.
//! It fills its outputs with NaN (never a stale or partial result) and records the error
//! here, against the stream it was queued on: cubecl's [`StreamId`], which is the queuing
//! thread's own unless burn's fusion backend set another while it executes an operation
//! (the operation's, that is the thread that queued it). The next call of this crate on that
//! stream takes the error and returns it as [`SlideSparseError::Deferred`]; calls on other
//! streams (another thread, another model's) never see it.
//!
//! Inside a fused execution a call does not take its stream's error: it could only record
//! it again (it cannot return it either), and its own outputs would be NaN for nothing.
//! [`executing`] marks those calls; the stream's next queuing call reports the error.
//!
//! A stream holds at most one error (the first; later ones of the same stream are dropped
//! until it is reported). An entry exists from a failure to the report; where the thread of
//! a stream ends before it calls again, its one error stays unread.

use std::{
    cell::Cell,
    collections::{HashMap, hash_map::Entry},
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use burn::tensor::StreamId;

use crate::error::{Result, SlideSparseError};

/// The first unreported failure of each stream that has one.
static FAILURES: Mutex<Option<HashMap<StreamId, SlideSparseError>>> = Mutex::new(None);

/// How many streams hold an unreported failure: lets a call skip the lock when none does
/// (every forward asks).
static PENDING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Depth of fused executions of this crate's operations running on this thread.
    static EXECUTING: Cell<u32> = const { Cell::new(0) };
}

/// Records `error` as the failure of work queued on `stream`, unless the stream already
/// holds one. A [`SlideSparseError::Deferred`] is recorded as the error it carries, so the
/// report never nests.
pub fn record(stream: StreamId, error: SlideSparseError) {
    let error = match error {
        SlideSparseError::Deferred(inner) => *inner,
        other => other,
    };
    let mut failures = FAILURES.lock().unwrap_or_else(|e| e.into_inner());
    if let Entry::Vacant(slot) = failures.get_or_insert_with(HashMap::new).entry(stream) {
        slot.insert(error);
        PENDING.fetch_add(1, Ordering::Release);
    }
}

/// [`record`] against the current stream (cubecl's [`StreamId::current`]).
pub fn record_current(error: SlideSparseError) {
    record(StreamId::current(), error);
}

/// The failure recorded for the current stream, as [`SlideSparseError::Deferred`], taken
/// (reported once); `Ok` when there is none, and inside a fused execution ([`executing`]).
pub fn take_current() -> Result<()> {
    if PENDING.load(Ordering::Acquire) == 0 || EXECUTING.with(Cell::get) > 0 {
        return Ok(());
    }
    let stream = StreamId::current();
    let mut failures = FAILURES.lock().unwrap_or_else(|e| e.into_inner());
    match failures.as_mut().and_then(|f| f.remove(&stream)) {
        None => Ok(()),
        Some(error) => {
            PENDING.fetch_sub(1, Ordering::Release);
            Err(SlideSparseError::Deferred(Box::new(error)))
        }
    }
}

/// Runs `execute`, the execution of one of this crate's fused operations, with the stream's
/// failures left for the stream's next queuing call (module docs).
pub fn executing<T>(execute: impl FnOnce() -> T) -> T {
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            EXECUTING.with(|d| d.set(d.get() - 1));
        }
    }
    EXECUTING.with(|d| d.set(d.get() + 1));
    let _depth = Depth;
    execute()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream no other test uses (cubecl never hands out the same id twice, and these
    /// are far past any thread's).
    fn stream(n: u64) -> StreamId {
        StreamId {
            value: u64::MAX - 1000 - n,
        }
    }

    fn failure(what: &str) -> SlideSparseError {
        SlideSparseError::Backend(what.into())
    }

    fn reported(stream: StreamId) -> Option<String> {
        stream.executes(take_current).err().map(|e| match e {
            SlideSparseError::Deferred(inner) => inner.to_string(),
            other => panic!("not a deferred error: {other}"),
        })
    }

    #[test]
    fn a_failure_is_reported_once_and_only_on_its_own_stream() {
        let (failed, other) = (stream(1), stream(2));
        record(failed, failure("launch failed"));
        assert_eq!(reported(other), None, "another stream saw the failure");
        assert_eq!(reported(failed).as_deref(), Some("launch failed"));
        assert_eq!(reported(failed), None, "reported twice");
    }

    #[test]
    fn the_first_failure_of_a_stream_is_kept_and_never_nested() {
        let s = stream(3);
        record(s, SlideSparseError::Deferred(Box::new(failure("first"))));
        record(s, failure("second"));
        assert_eq!(reported(s).as_deref(), Some("first"));
        record(s, failure("third"));
        assert_eq!(reported(s).as_deref(), Some("third"));
    }

    #[test]
    fn a_fused_execution_leaves_the_failure_for_the_next_queuing_call() {
        let s = stream(4);
        record(s, failure("earlier operation"));
        let inside = s.executes(|| executing(take_current));
        assert!(inside.is_ok(), "a fused execution took the failure");
        assert_eq!(reported(s).as_deref(), Some("earlier operation"));
    }

    #[test]
    fn threads_record_and_take_their_own_streams_failures() {
        let threads: Vec<_> = (0..8)
            .map(|i| {
                std::thread::spawn(move || {
                    if i % 2 == 0 {
                        record_current(failure(&format!("thread {i}")));
                    }
                    (i, take_current().err().map(|e| e.to_string()))
                })
            })
            .collect();
        for thread in threads {
            let (i, got) = thread.join().unwrap();
            match got {
                Some(message) => {
                    assert_eq!(i % 2, 0, "thread {i} was given another's failure");
                    assert!(message.contains(&format!("thread {i}")), "{message}");
                }
                None => assert_eq!(i % 2, 1, "thread {i} lost its failure"),
            }
        }
    }
}
