//! What a method parameter is: whether it is set once or per model ([`ParamScope`]), the values
//! it takes ([`Range`]), its default ([`ParamDefault`]) — the vocabulary of `method::catalog`'s
//! tables, a leaf. Errors and `rlmerge methods` say ranges and defaults in the words here.

/// Whether a parameter is set once for the whole method or per model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamScope {
    /// Set once for the whole method (a recipe's top-level `parameters:`).
    MethodWide,
    /// Set for each model (a model's `parameters:`), or once for all.
    PerModel,
}

/// The values a parameter accepts; every value of a setting (a scalar, each point of a gradient,
/// each conditional value) must lie in it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Range {
    /// A finite number in [lo, hi] (an infinite bound: unbounded on that side).
    Number {
        /// Lowest value allowed.
        lo: f64,
        /// Highest value allowed.
        hi: f64,
    },
    /// A whole number in [lo, hi].
    Integer {
        /// Lowest value allowed.
        lo: f64,
        /// Highest value allowed.
        hi: f64,
    },
    /// `true` or `false`.
    Bool,
    /// One of these words.
    Choice(&'static [&'static str]),
    /// A local folder.
    Folder,
}

impl Range {
    /// What a value must be, as errors say it: "in [0, 1]", "≥ 0", "a finite number", "true or
    /// false", …
    pub fn requirement(self) -> String {
        match self {
            Range::Number { lo, hi } if !lo.is_finite() && !hi.is_finite() => {
                "a finite number".into()
            }
            Range::Number { lo, hi } if lo.is_finite() && hi.is_finite() => {
                format!("in {}", self.text())
            }
            Range::Number { .. } => self.text(),
            Range::Integer { .. } => {
                format!("a whole number in {}", &self.text()["whole ".len()..])
            }
            Range::Bool => "true or false".into(),
            Range::Choice(words) => format!("one of {}", words.join(", ")),
            Range::Folder => "a folder".into(),
        }
    }

    /// The range as `rlmerge methods` and errors write it.
    pub fn text(self) -> String {
        let num = |x: f64| -> String {
            if x.abs() >= 1e4 {
                format!("{x:e}")
            } else {
                format!("{x}")
            }
        };
        match self {
            Range::Number { lo, hi } | Range::Integer { lo, hi } => {
                let whole = if matches!(self, Range::Integer { .. }) {
                    "whole "
                } else {
                    ""
                };
                match (lo.is_finite(), hi.is_finite()) {
                    (true, true) => format!("{whole}[{}, {}]", num(lo), num(hi)),
                    (true, false) => format!("{whole}≥ {}", num(lo)),
                    (false, true) => format!("{whole}≤ {}", num(hi)),
                    (false, false) => "finite".to_string(),
                }
            }
            Range::Bool => "true/false".to_string(),
            Range::Choice(words) => words.join("/"),
            Range::Folder => "folder".to_string(),
        }
    }
}

/// A parameter's default, typed: the one source of every default the planner applies and
/// `rlmerge methods` prints.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ParamDefault {
    /// No default: the parameter must be given.
    Required,
    /// This number.
    Number(f64),
    /// This truth value.
    Bool(bool),
    /// This word.
    Word(&'static str),
    /// RAM+'s α: one default in global scope, another in tensor scope.
    ByScope {
        /// The default in global scope.
        global: f64,
        /// The default in tensor scope.
        tensor: f64,
    },
}

impl ParamDefault {
    /// The default as `rlmerge methods` prints it (whole numbers of an integer parameter
    /// without a fraction).
    pub fn text(self, range: Range) -> String {
        match self {
            ParamDefault::Required => "required".into(),
            ParamDefault::Number(x) if matches!(range, Range::Integer { .. }) => format!("{x}"),
            ParamDefault::Number(x) => format!("{x:?}"),
            ParamDefault::Bool(b) => b.to_string(),
            ParamDefault::Word(w) => w.into(),
            ParamDefault::ByScope { global, tensor } => format!("{global:?} ({tensor:?} tensor)"),
        }
    }

    /// The default number, when it is one.
    pub fn number(self) -> Option<f64> {
        match self {
            ParamDefault::Number(x) => Some(x),
            _ => None,
        }
    }
}

/// The floating-point type a number parameter is computed in: a value must be finite there, not
/// only as written (1e39 is a finite f64 and +∞ as an f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compute {
    /// It enters the merge's f32 arithmetic (a threshold, weight or scale of f32 values).
    F32,
    /// It is used in f64 only (a tolerance, a spectral coefficient computed in f64).
    F64,
}

impl Compute {
    /// Whether `x` is finite once in this type.
    pub fn finite(self, x: f64) -> bool {
        match self {
            Compute::F32 => (x as f32).is_finite(),
            Compute::F64 => x.is_finite(),
        }
    }
}

/// One parameter of a method: its name, scope, default, range and meaning.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Param {
    /// The name a recipe or `--param` gives it.
    pub name: &'static str,
    /// Whether it is set once or per model.
    pub scope: ParamScope,
    /// Its value when not given.
    pub default: ParamDefault,
    /// The values it takes.
    pub range: Range,
    /// What it does, in a line.
    pub about: &'static str,
    /// The type a number is computed in (every value must be finite there).
    pub compute: Compute,
}

impl Param {
    /// This parameter computed in f64 rather than f32.
    pub const fn in_f64(self) -> Param {
        Param {
            compute: Compute::F64,
            ..self
        }
    }
}
