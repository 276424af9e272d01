//! Memory over time as SVG: the log's live bytes, and for replays each stack's
//! footprint and its pool's largest free block.

use std::path::Path;

use plotters::prelude::*;

use crate::replay::{Outcome, Plan};

/// One line of the plot: a name and (seconds, bytes) points.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    style: ShapeStyle,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// At most this many points per line: plots of long logs stay small and quick.
const MAX_POINTS: usize = 4000;

/// Fails at once, naming the path, where the plot could not be written later (a missing
/// folder, a folder in its place, the log itself): checked before a long replay rather
/// than after it. Opens nothing: the plot is written only once the log has been read
/// whole, and never over the log.
pub(crate) fn check_writable(out: &Path, log: &Path) -> Result<(), String> {
    let named = |what: &str| format!("{}: {what}", out.display());
    if same_file(out, log) {
        return Err(named(
            "is the log being read; the plot would replace it: give another output file",
        ));
    }
    match std::fs::metadata(out) {
        Ok(m) if m.is_dir() => Err(named("is a folder; give a file name for the SVG")),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let folder = out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            match std::fs::metadata(folder) {
                Ok(m) if m.is_dir() => Ok(()),
                Ok(_) => Err(named(&format!("{} is not a folder", folder.display()))),
                Err(e) => Err(named(&format!("{}: {e}", folder.display()))),
            }
        }
        Err(e) => Err(named(&e.to_string())),
    }
}

/// Whether `a` and `b` name one file (through links or other spellings too).
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        #[cfg(unix)]
        (Ok(a), Ok(b)) => {
            use std::os::unix::fs::MetadataExt;
            (a.dev(), a.ino()) == (b.dev(), b.ino())
        }
        #[cfg(not(unix))]
        (Ok(_), Ok(_)) => a.canonicalize().ok() == b.canonicalize().ok(),
        _ => false,
    }
}

/// Writes `text` to `out` through a file beside it renamed over `out` when whole: a
/// failure part way leaves what `out` held before.
fn replace_file(out: &Path, text: &str) -> Result<(), String> {
    let name = out.file_name().unwrap_or_default().to_string_lossy();
    let part = out.with_file_name(format!(".{name}.memres-part"));
    let written = std::fs::write(&part, text).and_then(|()| std::fs::rename(&part, out));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&part);
        format!("writing the plot {}: {e}", out.display())
    })
}

/// Writes the plot of `plan` (and `replays`: stack name and outcome) to `out`.
pub(crate) fn write(
    out: &Path,
    title: &str,
    plan: &Plan,
    replays: &[(String, Outcome)],
) -> Result<(), String> {
    let seconds = |op: usize| plan.micros.get(op).copied().unwrap_or(0) as f64 / 1e6;
    let step = plan.len().div_ceil(MAX_POINTS).max(1);
    let mut series = vec![Series {
        name: "live bytes (log)".into(),
        points: (0..plan.len())
            .step_by(step)
            .chain(plan.len().checked_sub(1))
            .map(|i| (seconds(i), plan.live[i] as f64))
            .collect(),
        style: BLACK.stroke_width(2),
    }];
    for (i, (name, outcome)) in replays.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let keep = outcome.samples.len().div_ceil(MAX_POINTS).max(1);
        series.push(Series {
            name: format!("{name}: footprint"),
            points: outcome
                .samples
                .iter()
                .step_by(keep)
                .map(|s| (seconds(s.op), s.footprint.max(0) as f64))
                .collect(),
            style: color.stroke_width(2),
        });
        if outcome.samples.iter().any(|s| s.largest_free.is_some()) {
            series.push(Series {
                name: format!("{name}: largest free block"),
                points: outcome
                    .samples
                    .iter()
                    .step_by(keep)
                    .filter_map(|s| Some((seconds(s.op), s.largest_free? as f64)))
                    .collect(),
                style: color.mix(0.6).stroke_width(1),
            });
        }
    }
    let x_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(0.0f64, f64::max)
        .max(1e-6);
    let y_top = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max)
        .max(1.0);
    let (unit, scale) = [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ]
    .into_iter()
    .find(|&(_, s)| y_top >= s as f64)
    .unwrap_or(("B", 1));
    let scale = scale as f64;
    let fail = |e: &dyn std::fmt::Display| format!("writing the plot {}: {e}", out.display());
    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..x_max * 1.02, 0.0..y_top / scale * 1.08)
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("time since the first event (s)")
        .y_desc(format!("memory ({unit})"))
        .draw()
        .map_err(|e| fail(&e))?;
    for s in series {
        let style = s.style;
        chart
            .draw_series(LineSeries::new(
                s.points.into_iter().map(|(x, y)| (x, y / scale)),
                style,
            ))
            .map_err(|e| fail(&e))?
            .label(s.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    drop(chart);
    drop(root);
    replace_file(out, &svg)
}
