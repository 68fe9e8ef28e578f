//! Next-token choice: greedy, or temperature + nucleus (top-p) sampling.

use rand::{Rng, rngs::StdRng};

/// How to pick the next token from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability sums to at least `top_p`.
    pub top_p: f32,
}

impl Sampling {
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_p: 1.0,
    };

    /// Checks the parameters (temperature >= 0, 0 < top_p <= 1).
    pub fn new(temperature: f32, top_p: f32) -> Result<Self, String> {
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {temperature}"));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(format!("top-p must be in (0, 1], got {top_p}"));
        }
        Ok(Self { temperature, top_p })
    }

    /// The chosen token id. Non-finite logits are never chosen unless all are.
    pub fn pick(&self, logits: &[f32], rng: &mut StdRng) -> u32 {
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(i, _)| i as u32)
        };
        if self.temperature == 0.0 {
            return argmax();
        }
        let max = logits[argmax() as usize];
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, ((v - max) / self.temperature).exp()))
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f32 = probs.iter().map(|p| p.1).sum();
        // The nucleus: the most likely tokens until their mass reaches top_p.
        let mut mass = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                mass += p.1 / total;
                mass >= self.top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        let kept: f32 = probs.iter().map(|p| p.1).sum();
        let mut r = rng.random_range(0.0..kept);
        for (id, p) in &probs {
            if r < *p {
                return *id;
            }
            r -= p;
        }
        probs.last().map_or_else(argmax, |p| p.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn greedy_and_tiny_top_p_pick_the_argmax() {
        let logits = [0.1, 3.0, -1.0, f32::NAN, 2.9];
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(Sampling::GREEDY.pick(&logits, &mut rng), 1);
        let nucleus = Sampling::new(1.0, 1e-6).unwrap();
        for _ in 0..50 {
            assert_eq!(nucleus.pick(&logits, &mut rng), 1);
        }
    }

    #[test]
    fn sampling_follows_the_softmax_within_the_nucleus() {
        // p = softmax([ln 6, ln 3, ln 1]) = [0.6, 0.3, 0.1]; top-p 0.85 keeps the first two.
        let logits = [6f32.ln(), 3f32.ln(), 0.0];
        let mut rng = StdRng::seed_from_u64(2);
        let s = Sampling::new(1.0, 0.85).unwrap();
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            counts[s.pick(&logits, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[2], 0, "outside the nucleus");
        let share = counts[0] as f64 / 20_000.0;
        assert!((share - 2.0 / 3.0).abs() < 0.02, "{share}");
    }

    #[test]
    fn bad_parameters_are_errors() {
        assert!(Sampling::new(-1.0, 0.9).is_err());
        assert!(Sampling::new(1.0, 0.0).is_err());
        assert!(Sampling::new(1.0, 1.5).is_err());
        assert!(Sampling::new(f32::NAN, 0.9).is_err());
    }
}
