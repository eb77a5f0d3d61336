//! `tally-bench`, the end of a run: the targets of issue 23 in one table, each figure with
//! its measured values, its ratio, the target and whether it was met. Every ratio is taken
//! within the run: each part returns the rows whose figures it measured (see `Row`), and
//! `run` prints them after the last part. Rows of parts that did not run are left out,
//! and the table says which part gives them.

use crate::{print_table, verdict, Part};

/// The figures of the table, in its order, each with the part (and option) that gives it.
const FIGURES: [(Figure, &str); 7] = [
    (Figure::Single, "the ingest part"),
    (Figure::Outside, "the ingest part with --outside"),
    (Figure::Batches, "the ingest part"),
    (Figure::Nats, "the ingest part"),
    (Figure::PacedChecks, "the admission part"),
    (Figure::ClosedChecks, "the admission part"),
    (Figure::Replay, "the projection part"),
];

/// One figure of issue 23's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    /// HTTP single events against the yardstick, in the bench's process.
    Single,
    /// The same driven from outside: `wrk` against `pgbench` doing the yardstick.
    Outside,
    /// HTTP batches against raw `INSERT … UNNEST` of the same rows.
    Batches,
    /// NATS ingest against the HTTP batches of the same run.
    Nats,
    /// Paced admission checks while events arrive, p99 from when due, against the paced
    /// `/healthz` p99.
    PacedChecks,
    /// Closed-loop admission checks' p99 against closed-loop `/healthz`'s.
    ClosedChecks,
    /// `tally replay`'s rate.
    Replay,
}

impl Figure {
    /// The figure as the table names it.
    pub fn label(self) -> &'static str {
        match self {
            Figure::Single => "HTTP single events vs INSERT 1 row/tx, 16 connections (in-process)",
            Figure::Outside => "HTTP single events by wrk, 64 connections, vs pgbench -c 16 INSERT 1 row/tx",
            Figure::Batches => "HTTP batches vs INSERT UNNEST of the same rows",
            Figure::Nats => "NATS ingest, publish to committed, vs HTTP batches",
            Figure::PacedChecks => {
                "admission checks paced while events arrive, p99 from when due, vs paced /healthz p99"
            }
            Figure::ClosedChecks => "admission checks closed loop p99 vs /healthz closed loop p99",
            Figure::Replay => "tally replay",
        }
    }
}

/// Which way a ratio has to go.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

impl Bound {
    fn holds(self, ratio: f64) -> bool {
        match self {
            Bound::AtLeast(bound) => ratio >= bound,
            Bound::AtMost(bound) => ratio <= bound,
        }
    }
}

/// One row of the targets table.
#[derive(Debug, Clone)]
pub struct Row {
    pub figure: Figure,
    /// The measured values the ratio is taken of, e.g. "12 000/s vs 6 000/s".
    pub measured: String,
    /// The first value over the second (for replay, the rate over the target rate).
    pub ratio: f64,
    pub bound: Bound,
    /// The target as issue 23 says it.
    pub target: String,
    /// For rates of events: what the whole machine spent per event, in microseconds, for
    /// the figure and for its reference, each over its own timed part. Two rates on the
    /// same cores differ by this much when both keep the cores busy; where the rate ratio
    /// is further off than this one, the figure was waiting, not working.
    pub cpu_per_event_us: Option<(f64, f64)>,
}

impl Row {
    /// A row whose ratio is `value / reference`, both described in `measured`.
    pub(crate) fn new(
        figure: Figure,
        measured: String,
        value: f64,
        reference: f64,
        bound: Bound,
        target: impl Into<String>,
    ) -> Row {
        Row {
            figure,
            measured,
            ratio: value / reference,
            bound,
            target: target.into(),
            cpu_per_event_us: None,
        }
    }

    /// The machine's CPU per event of the figure and of its reference, when both are known.
    pub(crate) fn with_cpu_per_event(
        mut self,
        figure_us: Option<f64>,
        reference_us: Option<f64>,
    ) -> Row {
        self.cpu_per_event_us = figure_us.zip(reference_us);
        self
    }

    pub fn met(&self) -> bool {
        self.bound.holds(self.ratio)
    }
}

/// What a run measured against the targets: the rows of the parts that ran, in the
/// table's order, and the parts that ran.
#[derive(Debug, Default)]
pub struct Summary {
    pub rows: Vec<Row>,
    parts: Vec<Part>,
}

impl Summary {
    /// Adds a part's rows, once the part has run.
    pub(crate) fn add(&mut self, part: Part, rows: Vec<Row>) {
        self.parts.push(part);
        self.rows.extend(rows);
        let order = |row: &Row| FIGURES.iter().position(|(figure, _)| *figure == row.figure);
        self.rows.sort_by_key(order);
    }

    /// The parts that ran, in the order they ran.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The row of `figure`, when its part ran.
    pub fn row(&self, figure: Figure) -> Option<&Row> {
        self.rows.iter().find(|row| row.figure == figure)
    }

    /// Prints the table, then the figures left out and which part gives them. Prints
    /// nothing when no part that gives a figure ran.
    pub(crate) fn print(&self) {
        if self.rows.is_empty() {
            return;
        }
        println!();
        println!("tally-bench, targets (issue 23; every ratio within this run):");
        println!();
        let header = [
            "figure",
            "measured",
            "ratio",
            "target",
            "verdict",
            "machine CPU an event",
        ];
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|row| {
                vec![
                    row.figure.label().to_owned(),
                    row.measured.clone(),
                    format!("{:.3}", row.ratio),
                    row.target.clone(),
                    verdict(row.met()).to_owned(),
                    row.cpu_per_event_us
                        .map_or_else(crate::dash, |(figure, reference)| {
                            format!(
                                "{figure:.0} µs vs {reference:.0} µs ({:.2} ×)",
                                figure / reference
                            )
                        }),
                ]
            })
            .collect();
        print_table(&header, &cells);
        println!();
        for (figure, part) in FIGURES {
            if self.row(figure).is_none() {
                println!("- left out: {} ({part})", figure.label());
            }
        }
    }
}

/// A rate, rounded to whole units a second.
pub(crate) fn per_second(rate: f64) -> String {
    format!("{rate:.0}/s")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(figure: Figure, ratio: f64, bound: Bound) -> Row {
        Row::new(figure, "measured".to_owned(), ratio, 1.0, bound, "target")
    }

    #[test]
    fn a_ratio_meets_a_bound_on_its_side_of_it_and_on_it() {
        for (ratio, bound, met) in [
            (1.5, Bound::AtLeast(1.5), true),
            (1.49, Bound::AtLeast(1.5), false),
            (4.0, Bound::AtMost(4.0), true),
            (4.01, Bound::AtMost(4.0), false),
            (f64::NAN, Bound::AtMost(4.0), false),
        ] {
            assert_eq!(
                row(Figure::Single, ratio, bound).met(),
                met,
                "{ratio} {bound:?}"
            );
        }
    }

    #[test]
    fn a_row_gives_the_machines_cpu_per_event_only_when_both_sides_were_measured() {
        let measured = row(Figure::Single, 1.0, Bound::AtLeast(1.5));
        assert_eq!(
            measured
                .clone()
                .with_cpu_per_event(Some(170.0), Some(200.0))
                .cpu_per_event_us,
            Some((170.0, 200.0))
        );
        for (figure, reference) in [(None, Some(200.0)), (Some(170.0), None), (None, None)] {
            assert_eq!(
                measured
                    .clone()
                    .with_cpu_per_event(figure, reference)
                    .cpu_per_event_us,
                None
            );
        }
    }

    #[test]
    fn rows_are_kept_in_the_order_of_the_table_whatever_order_the_parts_ran_in() {
        let mut summary = Summary::default();
        summary.add(
            Part::Projection,
            vec![row(Figure::Replay, 1.0, Bound::AtLeast(1.0))],
        );
        summary.add(
            Part::Ingest,
            vec![
                row(Figure::Nats, 1.0, Bound::AtLeast(1.0)),
                row(Figure::Single, 1.0, Bound::AtLeast(1.5)),
            ],
        );
        let figures: Vec<Figure> = summary.rows.iter().map(|row| row.figure).collect();
        assert_eq!(figures, [Figure::Single, Figure::Nats, Figure::Replay]);
        assert_eq!(summary.parts(), [Part::Projection, Part::Ingest]);
    }
}
