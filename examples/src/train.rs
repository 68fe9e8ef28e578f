//! Training objectives and the learning-rate schedule of the `finetune_then_pack` example:
//! next-token cross entropy, distillation from a teacher's logits, and their mix.

use burn::tensor::{Int, Tensor, activation::log_softmax, backend::Backend};

/// What a fine-tuning step minimizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Objective {
    /// Next-token cross entropy on the training text.
    Lm,
    /// KL divergence from the dense teacher's next-token distribution to the student's.
    Kl,
    /// The sum of both.
    KlLm,
}

impl Objective {
    /// Whether the objective needs the teacher's logits.
    pub fn needs_teacher(self) -> bool {
        matches!(self, Objective::Kl | Objective::KlLm)
    }
}

/// Mean next-token cross entropy of `logits [batch, t, vocab]` against `targets [batch, t]`.
pub fn lm_loss<B: Backend>(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [batch, t, vocab] = logits.dims();
    let logp = log_softmax(logits.reshape([batch * t, vocab]), 1);
    logp.gather(1, targets.reshape([batch * t, 1])).mean().neg()
}

/// Mean over tokens of `KL(teacher || student)` = `sum_v p_t (log p_t - log p_s)`, both
/// `[batch, t, vocab]`. The teacher's logits carry no gradient (they come from the inner
/// backend); the loss is zero exactly when the two distributions agree.
pub fn kl_loss<B: Backend>(student: Tensor<B, 3>, teacher: Tensor<B, 3>) -> Tensor<B, 1> {
    let [batch, t, vocab] = student.dims();
    let log_s = log_softmax(student.reshape([batch * t, vocab]), 1);
    let log_t = log_softmax(teacher.reshape([batch * t, vocab]), 1);
    let p_t = log_t.clone().exp();
    (p_t * (log_t - log_s)).sum_dim(1).mean()
}

/// The learning rate of step `step` of `steps`: linear warm-up over the first `warmup`
/// steps, then linear decay to zero at the end (a constant rate keeps moving the weights
/// at full size when the run stops).
pub fn learning_rate(peak: f64, step: usize, steps: usize, warmup: usize) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let left = steps.saturating_sub(step) as f64;
    let span = steps.saturating_sub(warmup).max(1) as f64;
    peak * left / span
}

#[cfg(test)]
mod tests {
    use burn::{
        backend::NdArray,
        tensor::{Distribution, TensorData},
    };

    use super::*;

    type B = NdArray;

    fn scalar(t: Tensor<B, 1>) -> f64 {
        t.into_data().convert::<f64>().into_vec::<f64>().unwrap()[0]
    }

    fn logits(seed: u64, dims: [usize; 3]) -> Tensor<B, 3> {
        <B as Backend>::seed(&Default::default(), seed);
        Tensor::random(dims, Distribution::Normal(0.0, 3.0), &Default::default())
    }

    /// Direct definition in f64, element by element.
    fn kl_reference(s: &[f32], t: &[f32], vocab: usize) -> f64 {
        let log_softmax = |row: &[f32]| {
            let max = row.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            row.iter().map(|&v| v as f64 - lse).collect::<Vec<f64>>()
        };
        let rows = s.len() / vocab;
        let mut total = 0.0;
        for r in 0..rows {
            let ls = log_softmax(&s[r * vocab..(r + 1) * vocab]);
            let lt = log_softmax(&t[r * vocab..(r + 1) * vocab]);
            total += lt
                .iter()
                .zip(&ls)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>();
        }
        total / rows as f64
    }

    fn values(t: &Tensor<B, 3>) -> Vec<f32> {
        t.clone().into_data().convert::<f32>().into_vec().unwrap()
    }

    #[test]
    fn kl_matches_its_definition_and_vanishes_only_on_equal_distributions() {
        let dims = [2, 5, 37];
        for seed in 0..8 {
            let (s, t) = (logits(2 * seed, dims), logits(2 * seed + 1, dims));
            let expected = kl_reference(&values(&s), &values(&t), dims[2]);
            let got = scalar(kl_loss(s.clone(), t.clone()));
            assert!(expected > 0.1, "random logits differ");
            assert!(
                (got - expected).abs() < 1e-4 * expected.max(1.0),
                "{got} vs {expected}"
            );
            // Shifting every logit of a row by a constant leaves the distribution unchanged.
            let same = scalar(kl_loss(s.clone() + 4.5, s));
            assert!(
                same.abs() < 1e-5,
                "KL of a distribution with itself: {same}"
            );
        }
    }

    #[test]
    fn lm_loss_is_the_mean_negative_log_likelihood_of_the_targets() {
        let dims = [2, 3, 11];
        let l = logits(99, dims);
        let targets = [3i64, 0, 10, 7, 7, 1];
        let v = values(&l);
        let expected: f64 = targets
            .iter()
            .enumerate()
            .map(|(r, &tgt)| {
                let row = &v[r * 11..(r + 1) * 11];
                let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
                lse - row[tgt as usize] as f64
            })
            .sum::<f64>()
            / 6.0;
        let targets = Tensor::<B, 2, Int>::from_data(
            TensorData::new(targets.to_vec(), [2, 3]),
            &Default::default(),
        );
        let got = scalar(lm_loss(l, targets));
        assert!((got - expected).abs() < 1e-4, "{got} vs {expected}");
    }

    #[test]
    fn learning_rate_warms_up_then_decays_to_zero() {
        let lr: Vec<f64> = (0..10).map(|s| learning_rate(1.0, s, 10, 2)).collect();
        assert_eq!(lr[0], 0.5);
        assert_eq!(lr[1], 1.0);
        assert_eq!(lr[2], 1.0);
        assert!(lr.windows(2).skip(2).all(|w| w[1] < w[0]), "{lr:?}");
        assert_eq!(lr[9], 1.0 / 8.0);
        assert_eq!(learning_rate(1.0, 0, 1, 0), 1.0);
    }
}
