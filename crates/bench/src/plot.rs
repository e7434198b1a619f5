//! PNG line plots for the benchmark reports (plotters, text drawn with the DejaVu Sans font
//! from the system: Debian's fonts-dejavu-core).

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;

const FONT_PATHS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn register_font() -> Result<()> {
    static DONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        FONT_PATHS.iter().any(|p| {
            std::fs::read(p).is_ok_and(|bytes| {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
            })
        })
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!(
            "plots need DejaVu Sans (apt-get install fonts-dejavu-core)"
        ))
    }
}

/// One line per series; `log_x` for a logarithmic x axis.
pub fn lines(
    path: &str,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
) -> Result<()> {
    register_font()?;
    let xs = series.iter().flat_map(|s| s.1.iter().map(|p| p.0));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let y1 = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(1.0f64, f64::max)
        * 1.15;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
        macro_rules! body {
            ($chart:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .x_desc(x_label)
                    .y_desc(y_label)
                    .draw()?;
                for (i, (name, pts)) in series.iter().enumerate() {
                    let c = colors[i % colors.len()];
                    chart
                        .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))?
                        .label(name.as_str())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
                    chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))?;
                }
                chart
                    .configure_series_labels()
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .position(SeriesLabelPosition::UpperLeft)
                    .draw()?;
            }};
        }
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(title, ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(60);
        if log_x {
            body!(builder.build_cartesian_2d((x0 * 0.8..x1 * 1.25).log_scale(), 0.0..y1)?);
        } else {
            body!(builder.build_cartesian_2d(0.0..x1 * 1.05, 0.0..y1)?);
        }
        root.present()?;
        Ok(())
    };
    draw()
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("plotting {path}"))
}

/// Grouped bars: one group per entry of `groups`, one bar per series in each group.
pub fn bars(
    path: &str,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<f64>)],
) -> Result<()> {
    register_font()?;
    let y1 = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9)
        // Room above the bars for the legend, one line per series.
        * (1.2 + 0.07 * series.len().saturating_sub(4) as f64);
    let n = series.len().max(1) as f64;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let colors = [
            RED,
            BLUE,
            GREEN,
            MAGENTA,
            CYAN,
            BLACK,
            RGBColor(255, 140, 0),
            RGBColor(128, 0, 128),
            RGBColor(139, 69, 19),
            RGBColor(128, 128, 128),
        ];
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..groups.len() as f64, 0.0..y1)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(y_label)
            .draw()?;
        // Group names at the top of each group: plotters places axis labels at round values.
        chart.draw_series(groups.iter().enumerate().map(|(g, name)| {
            Text::new(
                name.clone(),
                (g as f64 + 0.1, y1 * 0.97),
                ("sans-serif", 17).into_font(),
            )
        }))?;
        for (k, (name, values)) in series.iter().enumerate() {
            let c = colors[k % colors.len()];
            let width = 0.8 / n;
            chart
                .draw_series(values.iter().enumerate().map(|(g, &v)| {
                    let x0 = g as f64 + 0.1 + k as f64 * width;
                    Rectangle::new([(x0, 0.0), (x0 + width * 0.9, v)], c.filled())
                }))?
                .label(name.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw()
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("plotting {path}"))
}
