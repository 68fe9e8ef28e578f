//! The unit tests' generator of random cases: xorshift32, deterministic and dependency-free.

/// Marsaglia's xorshift32; the seed must be nonzero.
pub(crate) struct XorShift32(pub(crate) u32);

impl XorShift32 {
    /// The next state, every nonzero `u32` once per period.
    pub(crate) fn next_u32(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        self.0
    }
}
