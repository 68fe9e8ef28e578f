//! Work run when the calling thread ends.
//!
//! cubecl keys a thread's launches by a `StreamId` it never reuses, and this crate keys its
//! per-stream state the same way (lanes with kept buffers and GEMM graphs, the attention
//! kernels' ordering). State made for a thread that has ended would never be used again;
//! the code that makes it registers its release here, and the thread's own thread-local
//! destructor runs it.

use std::cell::RefCell;

/// The releases registered on this thread, in order.
struct AtExit(RefCell<Vec<Box<dyn FnOnce()>>>);

impl Drop for AtExit {
    fn drop(&mut self) {
        for release in self.0.take() {
            release();
        }
    }
}

thread_local! {
    static AT_EXIT: AtExit = const { AtExit(RefCell::new(Vec::new())) };
}

/// Runs `release` when this thread ends. It runs in a thread-local destructor, so it must
/// not need other thread-locals; taking locks is fine (the ending thread holds none).
/// Registered while the thread's locals are being torn down (from another thread-local's
/// destructor), it never runs: the state it would release stays, nothing fails.
pub fn at_thread_exit(release: impl FnOnce() + 'static) {
    let _ = AT_EXIT.try_with(|at_exit| at_exit.0.borrow_mut().push(Box::new(release)));
}
