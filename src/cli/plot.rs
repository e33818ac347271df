//! Line charts (PNG or SVG by file extension) for `perplexity --plot` and
//! `cache-table --plot`, drawn with plotters.
//!
//! Text needs a TrueType font: the first of a few common system fonts is loaded at run
//! time (DejaVu/Liberation on Linux, Arial/Helvetica on macOS). Without one, the chart
//! is drawn without labels and a warning says so.

use crate::error::{Error, Result};
use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
];

/// Registers a system font as "sans-serif" once; false when none was found.
fn font_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        for p in FONT_CANDIDATES {
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        // A closed stderr must not turn a warning into a panic.
        let _ = super::out::err(format_args!(
            "warning: no TrueType font found; the chart has no labels\n"
        ));
        false
    })
}

/// One named line.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Draws `series` as lines into `path` (`.png` or `.svg`).
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<()> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
        .unwrap_or_default();
    let err = |e: String| Error::format(path, format!("cannot draw the chart: {e}"));
    match ext.as_str() {
        "png" => {
            let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
            draw(root, title, x_label, y_label, series).map_err(err)
        }
        "svg" => {
            let root = SVGBackend::new(path, (1000, 600)).into_drawing_area();
            draw(root, title, x_label, y_label, series).map_err(err)
        }
        _ => Err(Error::flag(
            "--plot",
            format!("{}: expected a .png or .svg file name", path.display()),
        )),
    }
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> std::result::Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: &dyn std::fmt::Display| x.to_string();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if x0 > x1 {
        return Err("no finite points to draw".into());
    }
    if x1 == x0 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.05).max(1e-9);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let labels = font_available();
    let mut b = ChartBuilder::on(&root);
    b.margin(20);
    if labels {
        b.caption(title, ("sans-serif", 24))
            .x_label_area_size(45)
            .y_label_area_size(70);
    } else {
        b.x_label_area_size(10).y_label_area_size(10);
    }
    let mut chart = b.build_cartesian_2d(x0..x1, y0..y1).map_err(|x| e(&x))?;
    let mut mesh = chart.configure_mesh();
    if labels {
        mesh.x_desc(x_label).y_desc(y_label);
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(|x| e(&x))?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let c2 = color;
        let line = chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|x| e(&x))?;
        if labels {
            line.label(s.name.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], c2.stroke_width(2))
            });
        }
    }
    if labels {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

/// Checks, before any work is done, that a chart can be written to `path`: a `.png` or
/// `.svg` name in an existing, writable directory. A file that did not exist is removed
/// again.
pub fn check_output(path: &Path) -> Result<()> {
    let bad = |m: String| Error::flag("--plot", format!("{}: {m}", path.display()));
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !ext.eq_ignore_ascii_case("png") && !ext.eq_ignore_ascii_case("svg") {
        return Err(bad("expected a .png or .svg file name".into()));
    }
    if path.is_dir() {
        return Err(bad("is a directory".into()));
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| {
            bad(format!(
                "cannot be written: {}",
                crate::error::io_message(&e)
            ))
        })?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
