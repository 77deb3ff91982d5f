//! `--plot FILE.svg`: for the callers refused most, one panel each: the units used in
//! the window, minute by minute (the most in each minute), against the quota line, with
//! the minutes in which requests were refused marked (a red cross, labelled with the
//! number refused).

use super::model::{Minute, Model};
use super::Interner;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

/// Callers plotted at most.
pub const CALLERS: usize = 6;

/// Draw `picked` ((limit name, caller) pairs, from [`super::report::Report::plotted`])
/// from the series `model` recorded, to the SVG file `path`.
///
/// Errors: the file cannot be written (the message says why).
pub fn write(
    path: &Path,
    model: &Model,
    names: &Interner,
    picked: &[(String, String)],
) -> Result<(), String> {
    let empty = BTreeMap::new();
    let panels: Vec<(String, &BTreeMap<u64, Minute>)> = picked
        .iter()
        .map(|(limit, caller)| {
            let series = model.series.as_ref().and_then(|s| {
                let li = model
                    .snapshot()
                    .limits
                    .iter()
                    .position(|l| &*l.name == limit.as_str())?;
                let id = names.ids.get(caller.as_str())?;
                s.get(&(li as u16, *id))
            });
            (
                format!("{caller} — limit {limit}"),
                series.unwrap_or(&empty),
            )
        })
        .collect();
    let height = 60 + 260 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    let e = |e: DrawingAreaErrorKind<_>| format!("{}: {e:?}", path.display());
    root.fill(&WHITE).map_err(e)?;
    let root = root
        .titled(
            "tollgate replay: units used in the window per minute, against the quota",
            ("sans-serif", 18),
        )
        .map_err(e)?;
    if panels.is_empty() {
        root.draw(&Text::new(
            "no caller was refused",
            (20, 20),
            ("sans-serif", 16),
        ))
        .map_err(e)?;
        root.present().map_err(e)?;
        return Ok(());
    }
    for (area, (title, series)) in root.split_evenly((panels.len(), 1)).iter().zip(&panels) {
        let first = series.keys().next().copied().unwrap_or(0);
        let last = series.keys().next_back().copied().unwrap_or(first) + 1;
        let quota = series.values().map(|m| m.quota).max().unwrap_or(0);
        let top = series
            .values()
            .map(|m| m.used)
            .max()
            .unwrap_or(0)
            .max(quota)
            .max(1);
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 15))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(first..last, 0u64..top + top / 10 + 1)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("minute (UTC)")
            .y_desc("units")
            .x_label_formatter(&|m| {
                let s = super::report::rfc3339(m * 60_000);
                s.get(11..16).unwrap_or("").to_string()
            })
            .draw()
            .map_err(e)?;
        chart
            .draw_series(LineSeries::new(
                series.iter().map(|(m, v)| (*m, v.used)),
                &BLUE,
            ))
            .map_err(e)?
            .label("used in the window")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        chart
            .draw_series(LineSeries::new([(first, quota), (last, quota)], &BLACK))
            .map_err(e)?
            .label("quota")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        chart
            .draw_series(series.iter().filter(|(_, v)| v.refused > 0).map(|(m, v)| {
                EmptyElement::at((*m, v.used.max(quota)))
                    + Cross::new((0, 0), 5, RED.stroke_width(2))
                    + Text::new(
                        format!("{} refused", v.refused),
                        (6, -12),
                        ("sans-serif", 11),
                    )
            }))
            .map_err(e)?
            .label("refused")
            .legend(|(x, y)| Cross::new((x + 10, y), 4, RED.stroke_width(2)));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}
