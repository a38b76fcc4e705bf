//! What a request asks of the sampler: llama.cpp's samplers, their settings and their order.

use serde_json::Value;

/// One of llama.cpp's samplers, by the name its `samplers` lists use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Repeat, frequency and presence penalties over the last `penalty_last_n` tokens.
    Penalties,
    /// DRY: penalises tokens that would extend a repeat of earlier text.
    Dry,
    /// Drops tokens more than `top_n_sigma` standard deviations of the logits below the best.
    TopNSigma,
    TopK,
    /// Locally typical sampling.
    TypicalP,
    TopP,
    MinP,
    /// Exclude Top Choices: sometimes removes all the likely tokens but the least likely of them.
    Xtc,
    /// Temperature (dynamic where `dynatemp_range` > 0).
    Temperature,
    /// llama.cpp's `infill` sampler (see [`infill`](super::infill)).
    Infill,
}

impl Step {
    /// llama.cpp's order when a request names none.
    pub const DEFAULT_CHAIN: [Step; 9] = [
        Step::Penalties,
        Step::Dry,
        Step::TopNSigma,
        Step::TopK,
        Step::TypicalP,
        Step::TopP,
        Step::MinP,
        Step::Xtc,
        Step::Temperature,
    ];

    /// The sampler a name in a `samplers` list stands for (llama.cpp's names, and the other spellings
    /// its command line takes: `top-k`, `nucleus`, `temp`, …); `None` for a name llama.cpp does not
    /// know either (it skips those); an error for its adaptive-p sampler, which this one lacks.
    pub fn from_name(name: &str) -> Result<Option<Step>, String> {
        let name = name.trim().to_lowercase().replace('-', "_");
        Ok(Some(match name.as_str() {
            "penalties" => Step::Penalties,
            "dry" => Step::Dry,
            "top_n_sigma" | "topnsigma" => Step::TopNSigma,
            "top_k" | "topk" => Step::TopK,
            "typ_p" | "typical_p" | "typical" | "typ" | "typp" => Step::TypicalP,
            "top_p" | "topp" | "nucleus" => Step::TopP,
            "min_p" | "minp" => Step::MinP,
            "xtc" => Step::Xtc,
            "temperature" | "temp" => Step::Temperature,
            "infill" => Step::Infill,
            "adaptive_p" | "adaptivep" => return Err("the adaptive-p sampler is not implemented".into()),
            _ => return Ok(None),
        }))
    }

    /// The sampler a letter of a `--sampling-seq` string stands for (`e d s k y p m x t i`).
    pub fn from_letter(c: char) -> Result<Option<Step>, String> {
        Ok(Some(match c {
            'e' => Step::Penalties,
            'd' => Step::Dry,
            's' => Step::TopNSigma,
            'k' => Step::TopK,
            'y' => Step::TypicalP,
            'p' => Step::TopP,
            'm' => Step::MinP,
            'x' => Step::Xtc,
            't' => Step::Temperature,
            'i' => Step::Infill,
            'a' => return Err("the adaptive-p sampler is not implemented".into()),
            _ => return Ok(None),
        }))
    }

    /// The name llama.cpp's `samplers` lists give it.
    pub fn name(self) -> &'static str {
        match self {
            Step::Penalties => "penalties",
            Step::Dry => "dry",
            Step::TopNSigma => "top_n_sigma",
            Step::TopK => "top_k",
            Step::TypicalP => "typ_p",
            Step::TopP => "top_p",
            Step::MinP => "min_p",
            Step::Xtc => "xtc",
            Step::Temperature => "temperature",
            Step::Infill => "infill",
        }
    }
}

/// DRY ("don't repeat yourself") settings, as llama.cpp names them.
#[derive(Debug, Clone, PartialEq)]
pub struct DryParams {
    /// 0 = off.
    pub multiplier: f32,
    /// The penalty grows as `base^(length − allowed_length)`; below 1, off.
    pub base: f32,
    /// Repeats up to this long go unpenalised.
    pub allowed_length: usize,
    /// How many recent tokens are searched for repeats (0 = off; `usize::MAX`: all of them).
    pub last_n: usize,
    /// Texts that end a repeat (a repeat never runs across one).
    pub sequence_breakers: Vec<String>,
}

impl Default for DryParams {
    fn default() -> Self {
        DryParams {
            multiplier: 0.0,
            base: 1.75,
            allowed_length: 2,
            last_n: 64,
            sequence_breakers: ["\n", ":", "\"", "*"].map(String::from).to_vec(),
        }
    }
}

impl DryParams {
    pub fn active(&self) -> bool {
        self.multiplier != 0.0 && self.base >= 1.0 && self.last_n != 0
    }
}

/// Sampling settings; every field is honoured.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 (or less) = greedy.
    pub temperature: f32,
    /// Dynamic temperature: the temperature moves within ± this with the candidates' entropy (0 = off).
    pub dynatemp_range: f32,
    /// How entropy maps to the dynamic temperature (1 = linearly).
    pub dynatemp_exponent: f32,
    /// 0 = disabled.
    pub top_k: usize,
    /// 1.0 = disabled.
    pub top_p: f32,
    /// 0.0 = disabled.
    pub min_p: f32,
    /// Locally typical sampling's mass (1.0 = off).
    pub typical_p: f32,
    /// ≤ 0 = off.
    pub top_n_sigma: f32,
    /// How often XTC acts (0 = off).
    pub xtc_probability: f32,
    /// The probability above which XTC removes tokens (over 0.5: off).
    pub xtc_threshold: f32,
    /// The fewest candidates top-p, min-p, typical-p and XTC leave.
    pub min_keep: usize,
    /// Divides positive / multiplies negative logits of recent tokens (1.0 = off).
    pub repeat_penalty: f32,
    /// Subtracted once from every recent token's logit (0 = off).
    pub presence_penalty: f32,
    /// Subtracted per occurrence of a recent token (0 = off).
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at (0 = none; `usize::MAX`: all of them).
    pub penalty_last_n: usize,
    pub dry: DryParams,
    /// Mirostat 1 or 2 in place of the chain (0 = off), its target surprise and learning rate.
    pub mirostat: u8,
    pub mirostat_tau: f32,
    pub mirostat_eta: f32,
    /// The samplers that run, in order, before the draw.
    pub chain: Vec<Step>,
    pub seed: Option<u64>,
    /// Added to these tokens' logits before anything else (`-inf` bans a token).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        // llama.cpp's defaults.
        SamplingParams {
            temperature: 0.8,
            dynatemp_range: 0.0,
            dynatemp_exponent: 1.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            min_keep: 0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            dry: DryParams::default(),
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            chain: Step::DEFAULT_CHAIN.to_vec(),
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Whether the chain runs `step`.
    pub fn runs(&self, step: Step) -> bool {
        self.chain.contains(&step)
    }

    /// Whether the infill sampler runs.
    pub fn infill(&self) -> bool {
        self.mirostat == 0 && self.runs(Step::Infill)
    }

    /// The breaker texts DRY needs found over the vocabulary ([`DryBreakers`](super::DryBreakers)),
    /// where it runs.
    pub fn dry_breakers_needed(&self) -> Option<&[String]> {
        (self.mirostat == 0 && self.runs(Step::Dry) && self.dry.active())
            .then_some(self.dry.sequence_breakers.as_slice())
    }

    /// Whether the sampler reads tokens' texts (the infill sampler, DRY), which a table over the
    /// vocabulary holds.
    pub fn reads_token_texts(&self) -> bool {
        self.infill() || self.dry_breakers_needed().is_some()
    }

    /// Whether `step`, where it runs, changes anything at these settings.
    pub fn acts(&self, step: Step) -> bool {
        match step {
            Step::Penalties => {
                self.penalty_last_n > 0
                    && (self.repeat_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0)
            }
            Step::Dry => self.dry.active(),
            Step::TopNSigma => self.top_n_sigma > 0.0,
            Step::TopK => self.top_k > 0,
            Step::TypicalP => self.typical_p < 1.0,
            Step::TopP => self.top_p < 1.0,
            Step::MinP => self.min_p > 0.0,
            Step::Xtc => self.xtc_probability > 0.0 && self.xtc_threshold <= 0.5,
            Step::Temperature => self.temperature != 1.0 || self.dynatemp_range > 0.0,
            Step::Infill => true,
        }
    }

    /// Checks ranges; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature must be ≥ 0, got {}", self.temperature));
        }
        if !self.dynatemp_range.is_finite() {
            return Err(format!("dynatemp_range must be finite, got {}", self.dynatemp_range));
        }
        if !self.dynatemp_exponent.is_finite() {
            return Err(format!("dynatemp_exponent must be finite, got {}", self.dynatemp_exponent));
        }
        for (name, v) in [("top_p", self.top_p), ("min_p", self.min_p), ("typical_p", self.typical_p)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} must be in [0, 1], got {v}"));
            }
        }
        if self.top_n_sigma.is_nan() {
            return Err("top_n_sigma must be a number".into());
        }
        if !(0.0..=1.0).contains(&self.xtc_probability) {
            return Err(format!("xtc_probability must be in [0, 1], got {}", self.xtc_probability));
        }
        if !(0.0..=1.0).contains(&self.xtc_threshold) {
            return Err(format!("xtc_threshold must be in [0, 1], got {}", self.xtc_threshold));
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return Err(format!("repeat_penalty must be > 0, got {}", self.repeat_penalty));
        }
        if !self.presence_penalty.is_finite() {
            return Err("presence_penalty must be finite".into());
        }
        if !self.frequency_penalty.is_finite() {
            return Err("frequency_penalty must be finite".into());
        }
        if !self.dry.multiplier.is_finite() || self.dry.multiplier < 0.0 {
            return Err(format!("dry_multiplier must be ≥ 0, got {}", self.dry.multiplier));
        }
        if !self.dry.base.is_finite() {
            return Err(format!("dry_base must be finite, got {}", self.dry.base));
        }
        if self.dry.active() && self.dry.sequence_breakers.iter().any(String::is_empty) {
            return Err("dry_sequence_breakers must not hold an empty string".into());
        }
        if self.mirostat > 2 {
            return Err(format!("mirostat must be 0 (off), 1 or 2, got {}", self.mirostat));
        }
        if self.mirostat > 0 && !self.mirostat_tau.is_finite() {
            return Err(format!("mirostat_tau must be finite, got {}", self.mirostat_tau));
        }
        if self.mirostat > 0 && !self.mirostat_eta.is_finite() {
            return Err(format!("mirostat_eta must be finite, got {}", self.mirostat_eta));
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| b.is_nan() || *b == f32::INFINITY) {
            return Err(format!("logit_bias of token {t} must be a number or -inf, got {b}"));
        }
        if self.infill() {
            let top_k_at = self.chain.iter().position(|&s| s == Step::TopK);
            let infill_at = self.chain.iter().position(|&s| s == Step::Infill);
            let top_k_first = top_k_at.zip(infill_at).is_some_and(|(k, i)| k < i);
            if !(1..=super::MAX_TOP_K_ON_BACKEND).contains(&self.top_k) || !top_k_first {
                return Err(format!(
                    "samplers with infill need top_k between 1 and {} before it (the infill sampler compares every pair of candidates)",
                    super::MAX_TOP_K_ON_BACKEND
                ));
            }
        }
        Ok(())
    }
}

/// Sampling options a person gave (the CLI's flags, the server's): each one set replaces the model's
/// default.
#[derive(Debug, Clone, Default)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub dynatemp_range: Option<f32>,
    pub dynatemp_exponent: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub top_n_sigma: Option<f32>,
    pub xtc_probability: Option<f32>,
    pub xtc_threshold: Option<f32>,
    pub min_keep: Option<usize>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<usize>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub dry_multiplier: Option<f32>,
    pub dry_base: Option<f32>,
    pub dry_allowed_length: Option<usize>,
    pub dry_last_n: Option<usize>,
    pub dry_sequence_breakers: Option<Vec<String>>,
    pub mirostat: Option<u8>,
    pub mirostat_tau: Option<f32>,
    pub mirostat_eta: Option<f32>,
    pub chain: Option<Vec<Step>>,
    pub seed: Option<u64>,
}

impl SamplingOverrides {
    /// llama.cpp's defaults, then the model's `generation_config.json`, then these flags.
    pub fn resolve(&self, generation_config: Option<&Value>) -> SamplingParams {
        let mut p = SamplingParams::default();
        if let Some(g) = generation_config {
            let f = |k: &str| g.get(k).and_then(Value::as_f64).map(|v| v as f32);
            if let Some(v) = f("temperature") {
                p.temperature = v;
            }
            if let Some(v) = g.get("top_k").and_then(Value::as_u64) {
                p.top_k = v as usize;
            }
            if let Some(v) = f("top_p") {
                p.top_p = v;
            }
            if let Some(v) = f("min_p") {
                p.min_p = v;
            }
            if let Some(v) = f("typical_p") {
                p.typical_p = v;
            }
            if let Some(v) = f("repetition_penalty") {
                p.repeat_penalty = v;
            }
            if g.get("do_sample") == Some(&Value::Bool(false)) {
                p.temperature = 0.0;
            }
        }
        self.apply_to(&mut p);
        p
    }

    /// Replaces each setting of `p` that these override.
    pub fn apply_to(&self, p: &mut SamplingParams) {
        let o = self;
        fn set<T>(field: &mut T, v: Option<T>) {
            if let Some(v) = v {
                *field = v;
            }
        }
        set(&mut p.temperature, o.temperature);
        set(&mut p.dynatemp_range, o.dynatemp_range);
        set(&mut p.dynatemp_exponent, o.dynatemp_exponent);
        set(&mut p.top_k, o.top_k);
        set(&mut p.top_p, o.top_p);
        set(&mut p.min_p, o.min_p);
        set(&mut p.typical_p, o.typical_p);
        set(&mut p.top_n_sigma, o.top_n_sigma);
        set(&mut p.xtc_probability, o.xtc_probability);
        set(&mut p.xtc_threshold, o.xtc_threshold);
        set(&mut p.min_keep, o.min_keep);
        set(&mut p.repeat_penalty, o.repeat_penalty);
        set(&mut p.penalty_last_n, o.repeat_last_n);
        set(&mut p.presence_penalty, o.presence_penalty);
        set(&mut p.frequency_penalty, o.frequency_penalty);
        set(&mut p.dry.multiplier, o.dry_multiplier);
        set(&mut p.dry.base, o.dry_base);
        set(&mut p.dry.allowed_length, o.dry_allowed_length);
        set(&mut p.dry.last_n, o.dry_last_n);
        set(&mut p.dry.sequence_breakers, o.dry_sequence_breakers.clone());
        set(&mut p.mirostat, o.mirostat);
        set(&mut p.mirostat_tau, o.mirostat_tau);
        set(&mut p.mirostat_eta, o.mirostat_eta);
        set(&mut p.chain, o.chain.clone());
        p.seed = o.seed.or(p.seed);
    }
}
