//! cuSPARSELt, in cudarc's layering: [`sys`] (the symbols, loaded at run time), [`result`]
//! (typed statuses), and the owning types (the handle, descriptors, compression, plans)
//! re-exported here.

pub mod result;
mod safe;
pub mod sys;

pub use safe::*;
