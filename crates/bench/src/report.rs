//! Figures collected over the runs, and the markdown tables they are printed as: every
//! figure is the median of its runs, with the min and max beside it.

use std::fmt::Write as _;

/// How a figure is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// events/s, rounded to an integer.
    Rate,
    /// µs per event.
    MicrosPerEvent,
    /// milliseconds.
    Millis,
    /// MiB.
    Mib,
    /// a dimensionless ratio.
    Ratio,
    /// a count per event.
    PerEvent,
}

impl Unit {
    /// The unit's name, written after a value.
    pub fn label(self) -> &'static str {
        match self {
            Unit::Rate => "events/s",
            Unit::MicrosPerEvent => "µs/event",
            Unit::Millis => "ms",
            Unit::Mib => "MiB",
            Unit::Ratio => "×",
            Unit::PerEvent => "per event",
        }
    }

    /// `value` in this unit's format.
    pub fn format(self, value: f64) -> String {
        if !value.is_finite() {
            return "–".to_owned();
        }
        match self {
            Unit::Rate => group_thousands(value.round() as i64),
            Unit::MicrosPerEvent => format!("{value:.2}"),
            Unit::Millis => format!("{value:.3}"),
            Unit::Mib => format!("{value:.1}"),
            Unit::Ratio => format!("{value:.2}"),
            Unit::PerEvent => format!("{value:.2}"),
        }
    }
}

fn group_thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// One row of the table: a measure of a scenario over the runs.
#[derive(Debug, Clone)]
pub struct Figure {
    pub scenario: String,
    pub measure: String,
    pub unit: Unit,
    pub values: Vec<f64>,
}

impl Figure {
    /// The median (the mean of the middle two for an even count); NaN values are ignored.
    pub fn median(&self) -> f64 {
        let mut values: Vec<f64> = self.finite().collect();
        values.sort_by(f64::total_cmp);
        match values.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => values[n / 2],
            n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
        }
    }

    fn min(&self) -> f64 {
        self.finite().fold(f64::NAN, f64::min)
    }

    fn max(&self) -> f64 {
        self.finite().fold(f64::NAN, f64::max)
    }

    /// The values, NaN and infinities left out.
    fn finite(&self) -> impl Iterator<Item = f64> + '_ {
        self.values.iter().copied().filter(|v| v.is_finite())
    }
}

/// All figures, in the order they were first recorded.
#[derive(Debug, Default)]
pub struct Results {
    figures: Vec<Figure>,
}

impl Results {
    /// Adds one run's value of `measure` in `scenario`.
    /// Records each process's CPU seconds of `cpu` per event of `events` (µs/event), and
    /// their sum as `total`; returns the sum in µs/event.
    pub fn record_cpu(
        &mut self,
        scenario: &str,
        cpu: &[(&str, f64)],
        events: f64,
        total: &str,
    ) -> f64 {
        for (who, seconds) in cpu {
            self.record(scenario, who, Unit::MicrosPerEvent, seconds * 1e6 / events);
        }
        let sum = cpu.iter().map(|(_, seconds)| seconds).sum::<f64>() * 1e6 / events;
        self.record(scenario, total, Unit::MicrosPerEvent, sum);
        sum
    }

    pub fn record(&mut self, scenario: &str, measure: &str, unit: Unit, value: f64) {
        match self
            .figures
            .iter_mut()
            .find(|f| f.scenario == scenario && f.measure == measure)
        {
            Some(figure) => figure.values.push(value),
            None => self.figures.push(Figure {
                scenario: scenario.to_owned(),
                measure: measure.to_owned(),
                unit,
                values: vec![value],
            }),
        }
    }

    /// The figure of `measure` in `scenario`, if recorded.
    pub fn get(&self, scenario: &str, measure: &str) -> Option<&Figure> {
        self.figures
            .iter()
            .find(|f| f.scenario == scenario && f.measure == measure)
    }

    /// The value recorded for `measure` in `scenario` in run `run` (0-based).
    pub fn value(&self, scenario: &str, measure: &str, run: usize) -> Option<f64> {
        self.get(scenario, measure)
            .and_then(|f| f.values.get(run).copied())
    }

    /// The markdown table of every figure.
    pub fn table(&self) -> String {
        let mut out = String::from(
            "| scenario | measure | median | min | max | unit |\n|---|---|---:|---:|---:|---|\n",
        );
        let mut last_scenario = "";
        for f in &self.figures {
            let scenario = if f.scenario == last_scenario {
                ""
            } else {
                f.scenario.as_str()
            };
            last_scenario = &f.scenario;
            let _ = writeln!(
                out,
                "| {scenario} | {} | **{}** | {} | {} | {} |",
                f.measure,
                f.unit.format(f.median()),
                f.unit.format(f.min()),
                f.unit.format(f.max()),
                f.unit.label()
            );
        }
        out
    }
}

/// One of the targets, checked against a median.
#[derive(Debug, Clone)]
pub struct Target {
    pub what: String,
    pub goal: String,
    pub measured: String,
    pub met: Option<bool>,
}

/// The markdown table of the targets.
pub fn targets_table(targets: &[Target]) -> String {
    let mut out = String::from("| target | goal | measured (median) | met |\n|---|---|---:|---|\n");
    for t in targets {
        let met = match t.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "–",
        };
        let _ = writeln!(out, "| {} | {} | {} | {met} |", t.what, t.goal, t.measured);
    }
    out
}
