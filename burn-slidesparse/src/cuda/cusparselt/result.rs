//! cuSPARSELt statuses as typed errors, and the library's version number.

use std::ffi::CStr;

use super::sys::{CusparseLt, Status};
use crate::error::{Result, SlideSparseError};

impl CusparseLt {
    /// Turns the status of the call `call` into a result carrying
    /// `cusparseLtGetErrorString` ([`SlideSparseError::CusparseLt`]).
    pub fn check(&self, status: Status, call: &'static str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: the library returns a static NUL-terminated string for any status.
        let message = unsafe {
            let p = (self.cusparseLtGetErrorString)(status);
            if p.is_null() {
                "unknown error".into()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(SlideSparseError::CusparseLt {
            call,
            status,
            message,
        })
    }
}

/// `major.minor.patch` of a cuSPARSELt version number, which the library encodes as
/// `major * 10000 + minor * 100 + patch` (0.8.0 is 800, 0.10.0 is 1000).
pub fn version_string(version: i32) -> String {
    format!(
        "{}.{}.{}",
        version / 10000,
        version % 10000 / 100,
        version % 100
    )
}

/// The oldest version the bindings support: 0.8.0.
pub const MIN_VERSION: i32 = 800;

#[cfg(test)]
mod tests {
    use super::version_string;

    #[test]
    fn versions_decode_with_two_digit_minors() {
        assert_eq!(version_string(800), "0.8.0");
        assert_eq!(version_string(1000), "0.10.0");
        assert_eq!(version_string(1102), "0.11.2");
        assert_eq!(version_string(10203), "1.2.3");
    }
}
