//! The sampling flags, spelt as llama.cpp spells them (`--temp`, `--top-k`, `--dry-multiplier`,
//! `--mirostat`, `--samplers`, …), shared by `mlxcel run` and `mlxcel-server`. Each flag given
//! replaces the model's default (`generation_config.json`, then llama.cpp's).

use anyhow::{bail, Result};
use clap::Args;

use crate::engine::{SamplingOverrides, Step};

#[derive(Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long = "temp", env = "LLAMA_ARG_TEMPERATURE", visible_alias = "temperature", allow_negative_numbers = true)]
    pub temp: Option<f32>,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long = "top-k", env = "LLAMA_ARG_TOP_K", allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    /// Nucleus sampling threshold (1.0 = off).
    #[arg(long = "top-p", env = "LLAMA_ARG_TOP_P")]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than min-p × the most likely (0 = off).
    #[arg(long = "min-p", env = "LLAMA_ARG_MIN_P")]
    pub min_p: Option<f32>,
    /// Locally typical sampling, parameter p (1.0 = off).
    #[arg(long = "typical", visible_alias = "typical-p")]
    pub typical: Option<f32>,
    /// Top-nσ: drop tokens more than N standard deviations of the logits below the best (≤ 0 = off).
    #[arg(long = "top-nsigma", visible_alias = "top-n-sigma", allow_negative_numbers = true)]
    pub top_n_sigma: Option<f32>,
    /// XTC: how often the most likely tokens are excluded (0 = off).
    #[arg(long = "xtc-probability")]
    pub xtc_probability: Option<f32>,
    /// XTC: the probability above which tokens are excluded (over 0.5 = off).
    #[arg(long = "xtc-threshold")]
    pub xtc_threshold: Option<f32>,
    /// Penalise repeats of the last --repeat-last-n tokens (1.0 = off).
    #[arg(long = "repeat-penalty", env = "LLAMA_ARG_REPEAT_PENALTY")]
    pub repeat_penalty: Option<f32>,
    /// How many recent tokens the penalties consider (0 = off, -1 = the whole context).
    #[arg(long = "repeat-last-n", allow_negative_numbers = true)]
    pub repeat_last_n: Option<i64>,
    /// Lowers the logit of every token already seen by this much (0 = off).
    #[arg(long = "presence-penalty", env = "LLAMA_ARG_PRESENCE_PENALTY", allow_negative_numbers = true)]
    pub presence_penalty: Option<f32>,
    /// Lowers a seen token's logit by this much per time it was seen (0 = off).
    #[arg(long = "frequency-penalty", env = "LLAMA_ARG_FREQUENCY_PENALTY", allow_negative_numbers = true)]
    pub frequency_penalty: Option<f32>,
    /// DRY: penalty for tokens that extend a repeat (0 = off).
    #[arg(long = "dry-multiplier")]
    pub dry_multiplier: Option<f32>,
    /// DRY: how fast the penalty grows with the repeat's length (≥ 1).
    #[arg(long = "dry-base")]
    pub dry_base: Option<f32>,
    /// DRY: repeats up to this many tokens go unpenalised.
    #[arg(long = "dry-allowed-length")]
    pub dry_allowed_length: Option<usize>,
    /// DRY: how many recent tokens are searched (0 = off, -1 = the whole context).
    #[arg(long = "dry-penalty-last-n", allow_negative_numbers = true)]
    pub dry_penalty_last_n: Option<i64>,
    /// DRY: a text that ends a repeat (repeatable; replaces the defaults `\n`, `:`, `"`, `*`; "none"
    /// for no breakers).
    #[arg(long = "dry-sequence-breaker", value_name = "STRING")]
    pub dry_sequence_breaker: Vec<String>,
    /// Dynamic temperature: the temperature moves within ± this with the candidates' entropy (0 = off).
    #[arg(long = "dynatemp-range")]
    pub dynatemp_range: Option<f32>,
    /// Dynamic temperature: how entropy maps to temperature.
    #[arg(long = "dynatemp-exp")]
    pub dynatemp_exp: Option<f32>,
    /// Mirostat in place of the other samplers: 0 = off, 1 = Mirostat, 2 = Mirostat 2.0.
    #[arg(long = "mirostat")]
    pub mirostat: Option<u8>,
    /// Mirostat's learning rate (eta).
    #[arg(long = "mirostat-lr")]
    pub mirostat_lr: Option<f32>,
    /// Mirostat's target entropy (tau).
    #[arg(long = "mirostat-ent")]
    pub mirostat_ent: Option<f32>,
    /// The samplers that run, in order, separated by ';'
    /// (penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature by default; infill where asked for).
    #[arg(long = "samplers", value_name = "SAMPLERS", conflicts_with = "sampling_seq")]
    pub samplers: Option<String>,
    /// The samplers that run, one letter each (edskypmxt by default).
    #[arg(long = "sampling-seq", visible_alias = "sampler-seq", value_name = "SEQUENCE")]
    pub sampling_seq: Option<String>,
    /// Random seed (same seed, same output; -1 = random).
    #[arg(short = 's', long = "seed", env = "LLAMA_ARG_SEED", allow_negative_numbers = true)]
    pub seed: Option<i64>,
}

impl SamplingArgs {
    /// The flags as overrides of the model's defaults, or why one is out of range.
    pub fn overrides(&self) -> Result<SamplingOverrides> {
        let last_n = |flag: &str, v: Option<i64>| -> Result<Option<usize>> {
            match v {
                None => Ok(None),
                Some(-1) => Ok(Some(usize::MAX)),
                Some(n) if n >= 0 => Ok(Some(n as usize)),
                Some(n) => bail!("--{flag} must be ≥ -1 (the whole context), got {n}"),
            }
        };
        let seed = match self.seed {
            None | Some(-1) => None,
            Some(s) if s >= 0 => Some(s as u64),
            Some(s) => bail!("--seed must be ≥ 0 or -1 (random), got {s}"),
        };
        if let Some(b) = self.dry_base.filter(|b| b.is_nan() || *b < 1.0) {
            bail!("--dry-base must be at least 1, got {b}");
        }
        // As llama.cpp: the first breaker given replaces the defaults; "none" empties the list so far.
        let breakers = (!self.dry_sequence_breaker.is_empty()).then(|| {
            self.dry_sequence_breaker.iter().fold(Vec::new(), |mut list, b| {
                match b.as_str() {
                    "none" => list.clear(),
                    b => list.push(b.to_string()),
                }
                list
            })
        });
        let chain = match (&self.samplers, &self.sampling_seq) {
            // (Empty entries, as in a trailing `;`, are skipped, as llama.cpp skips them.)
            (Some(names), _) => Some(chain_of(
                "--samplers",
                names.split(';').filter(|n| !n.trim().is_empty()).map(|n| (n.to_string(), Step::from_name(n))),
            )?),
            (None, Some(letters)) => {
                Some(chain_of("--sampling-seq", letters.chars().map(|c| (c.to_string(), Step::from_letter(c))))?)
            }
            (None, None) => None,
        };
        // (`max(0.0)` below would make NaN greedy.)
        if self.temp.is_some_and(f32::is_nan) {
            bail!("--temp must be a number");
        }
        Ok(SamplingOverrides {
            temperature: self.temp.map(|t| t.max(0.0)),
            dynatemp_range: self.dynatemp_range,
            dynatemp_exponent: self.dynatemp_exp,
            top_k: self.top_k.map(|k| usize::try_from(k).unwrap_or(0)),
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical,
            top_n_sigma: self.top_n_sigma,
            xtc_probability: self.xtc_probability,
            xtc_threshold: self.xtc_threshold,
            min_keep: None,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: last_n("repeat-last-n", self.repeat_last_n)?,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            dry_multiplier: self.dry_multiplier,
            dry_base: self.dry_base,
            dry_allowed_length: self.dry_allowed_length,
            dry_last_n: last_n("dry-penalty-last-n", self.dry_penalty_last_n)?,
            dry_sequence_breakers: breakers,
            mirostat: self.mirostat,
            mirostat_tau: self.mirostat_ent,
            mirostat_eta: self.mirostat_lr,
            chain,
            seed,
        })
    }
}

/// The samplers named, or why one cannot run here. An unknown name is refused (llama.cpp skips it,
/// which leaves the flags of the sampler meant silently unused).
fn chain_of(flag: &str, steps: impl Iterator<Item = (String, Result<Option<Step>, String>)>) -> Result<Vec<Step>> {
    let chain: Vec<Step> = steps
        .map(|(name, step)| match step {
            Ok(Some(step)) => Ok(step),
            Ok(None) => Err(anyhow::anyhow!(
                "{flag}: unknown sampler `{name}` (penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, \
                 temperature, infill; or their letters e, d, s, k, y, p, m, x, t, i)"
            )),
            Err(e) => Err(anyhow::anyhow!("{flag}: {e}")),
        })
        .collect::<Result<_>>()?;
    if chain.is_empty() {
        bail!("{flag} names no sampler");
    }
    Ok(chain)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        s: SamplingArgs,
    }

    fn parse(args: &[&str]) -> Result<SamplingOverrides> {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied()))?.s.overrides()
    }

    #[test]
    fn llama_cpp_sampling_flags_become_overrides() {
        let o = parse(&[
            "--dry-multiplier",
            "0.8",
            "--dry-sequence-breaker",
            "\n",
            "--dry-sequence-breaker",
            "###",
            "--dry-penalty-last-n",
            "-1",
            "--mirostat",
            "2",
            "--mirostat-ent",
            "4",
            "--samplers",
            "top_k;typical;top-p;temp;",
            "--top-k",
            "-1",
            "-s",
            "-1",
        ])
        .unwrap();
        assert_eq!(o.dry_multiplier, Some(0.8));
        assert_eq!(o.dry_sequence_breakers, Some(vec!["\n".to_string(), "###".to_string()]));
        assert_eq!((o.dry_last_n, o.mirostat, o.mirostat_tau), (Some(usize::MAX), Some(2), Some(4.0)));
        assert_eq!(o.chain, Some(vec![Step::TopK, Step::TypicalP, Step::TopP, Step::Temperature]));
        assert_eq!((o.top_k, o.seed), (Some(0), None));
        let o = parse(&["--sampling-seq", "kpt", "--dry-sequence-breaker", "none", "--temp", "-1"]).unwrap();
        assert_eq!(o.chain, Some(vec![Step::TopK, Step::TopP, Step::Temperature]));
        assert_eq!((o.dry_sequence_breakers, o.temperature), (Some(Vec::new()), Some(0.0)));
        let o =
            parse(&["--dry-sequence-breaker", "a", "--dry-sequence-breaker", "none", "--dry-sequence-breaker", "b"]);
        assert_eq!(o.unwrap().dry_sequence_breakers, Some(vec!["b".to_string()]));
    }

    #[test]
    fn out_of_range_flags_are_refused_by_name() {
        for (args, says) in [
            (&["--dry-base", "0.5"][..], "--dry-base"),
            (&["--repeat-last-n", "-2"][..], "--repeat-last-n"),
            (&["--samplers", "top_k;adaptive_p"][..], "adaptive-p"),
            (&["--samplers", "top_k;frobnicate"][..], "unknown sampler `frobnicate`"),
            (&["--samplers", ""][..], "--samplers names no sampler"),
            (&["--sampling-seq", "kq"][..], "--sampling-seq: unknown sampler `q`"),
            (&["--temp", "nan"][..], "--temp"),
            (&["-s", "-5"][..], "--seed"),
        ] {
            let e = parse(args).unwrap_err().to_string();
            assert!(e.contains(says), "{args:?}: {e}");
        }
    }
}
