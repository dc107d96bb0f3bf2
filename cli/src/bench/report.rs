//! What a run prints and writes: the table's header and rows, the JSON rows, the SVG plot.

use super::Cell;
use super::args::{Args, human};
use super::cache;
use super::measure::{ASSUMED_LLC, MAX_ROTATION};
use ferrogloo::device::Transport;
use ferrogloo::{Context, Error, Result};
use std::path::PathBuf;

/// What the run's timing is, said once before the tables: how calls are timed, and whether
/// the caches are warm.
pub(super) fn timing_mode(args: &Args) {
    println!(
        "# timing: per call, every call after a barrier (and the buffers' reset); time = the slowest rank's; \
         time/min/p99 over the iterations{}",
        if args.osu { "; avg/min/max = each rank's mean per call, over the ranks (OSU)" } else { "" }
    );
    match (args.cold, cache::last_level()) {
        (false, _) => println!("# cache: warm (the same buffers every call)"),
        (true, llc) => println!(
            "# cache: cold: each cell rotates through buffers so that twice the last-level cache ({}) goes \
             through between two uses of one, at most {MAX_ROTATION} buffers: cells under {} stay partly warm{}",
            llc.map_or(format!("size unknown: {} assumed", human(ASSUMED_LLC)), |l| format!("{} from sysfs", human(l))),
            human(2 * llc.unwrap_or(ASSUMED_LLC) / (MAX_ROTATION - 1)),
            if args.op.iter().any(|o| o == "pingpong") {
                "; pingpong bounces one buffer 100 times per timed call, so it is warm after the first"
            } else {
                ""
            },
        ),
    }
}

pub(super) fn header(ctx: &Context, args: &Args, op: &str) {
    println!("#\n# {op}: {} ranks, type {}, reduction {}, root {}", ctx.size(), args.dtype, args.reduce, args.root);
    if args.osu {
        println!(
            "# {:>12} {:>13} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>7}",
            "size", "algorithm", "avg", "min", "max", "p50", "p99", "iters", "busbw", "#wrong"
        );
        println!(
            "# {:>12} {:>13} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>7}",
            "(B)", "", "(us)", "(us)", "(us)", "(us)", "(us)", "", "(GB/s)", ""
        );
        return;
    }
    println!(
        "# {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>10} {:>8} {:>8} {:>5} {:>10} {:>10} {:>10} {:>7}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "algorithm",
        "time",
        "algbw",
        "busbw",
        "eff",
        "min",
        "p99",
        "model",
        "#wrong"
    );
    println!(
        "# {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>10} {:>8} {:>8} {:>5} {:>10} {:>10} {:>10} {:>7}",
        "(B)", "(elements)", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", ""
    );
}

pub(super) fn print_cell(args: &Args, c: &Cell) {
    if args.osu {
        let [avg, min, max] = c.ranks;
        println!(
            "  {:>12} {:>13} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>8} {:>8.3} {:>7}",
            c.bytes,
            c.algorithm_label(),
            avg,
            min,
            max,
            c.p50,
            c.p99,
            c.iters,
            c.busbw,
            c.wrong
        );
        return;
    }
    let rooted = matches!(c.op.as_str(), "broadcast" | "reduce");
    let reducing = matches!(c.op.as_str(), "allreduce" | "reduce_scatter" | "reduce");
    println!(
        "  {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>10.1} {:>8.3} {:>8.3} {:>5} {:>10.1} {:>10.1} {:>10} {:>7}",
        c.bytes,
        c.count,
        args.dtype,
        if reducing { args.reduce.as_str() } else { "-" },
        if rooted { args.root.to_string() } else { "-1".to_string() },
        c.algorithm_label(),
        c.p50,
        c.algbw,
        c.busbw,
        c.efficiency().map_or("-".to_string(), |e| format!("{e:.2}")),
        c.min,
        c.p99,
        c.model.map_or("-".to_string(), |m| format!("{m:.1}")),
        c.wrong
    );
}

/// Appends the cells to `path`, one JSON object per line (the shared schema, plus `picked`:
/// the algorithm `auto` ran).
pub(super) fn write_json(path: &PathBuf, args: &Args, n: usize, transport: Transport, cells: &[Cell]) -> Result<()> {
    use std::io::Write;
    let mut out = String::new();
    for c in cells {
        let row = serde_json::json!({
            "impl": "ferrogloo", "op": c.op, "algorithm": c.algorithm.name(),
            "picked": c.picked.map(|a| a.name()), "ranks": n, "bytes": c.bytes,
            "dtype": args.dtype, "iters": c.iters, "p50_us": c.p50, "min_us": c.min, "p99_us": c.p99,
            "algbw_gbps": c.algbw, "busbw_gbps": c.busbw, "wrong": c.wrong,
            "memcpy_gbps": c.memcpy, "efficiency": c.efficiency(), "model_us": c.model,
            "avg_us": c.ranks[0], "rank_min_us": c.ranks[1], "rank_max_us": c.ranks[2],
            "timing": "per-call-barrier", "cache": if args.cold { "cold" } else { "warm" },
            "transport": transport.name(),
        });
        out.push_str(&row.to_string());
        out.push('\n');
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(out.as_bytes()))
        .map_err(|e| Error::io(format!("appending to {}", path.display()), e))
}

/// Colours told apart easily (Okabe and Ito's palette, safe for colour blindness, then grey
/// and brown); each collective also has a marker shape of its own.
const COLOURS: [(u8, u8, u8); 10] = [
    (0, 114, 178),
    (213, 94, 0),
    (0, 158, 115),
    (204, 121, 167),
    (230, 159, 0),
    (86, 180, 233),
    (0, 0, 0),
    (240, 228, 66),
    (128, 128, 128),
    (153, 79, 0),
];

pub(super) fn plot(
    path: &PathBuf,
    args: &Args,
    n: usize,
    cells: &[Cell],
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let drawn: Vec<&Cell> = cells.iter().filter(|c| c.bytes > 0).collect();
    if drawn.is_empty() {
        return Ok(());
    }
    // Sizes on a log2 axis, ticked at powers of two (4K, 64K, 1M).
    let log2 = |b: usize| (b as f64).log2();
    let xmin = drawn.iter().map(|c| log2(c.bytes)).fold(f64::INFINITY, f64::min).floor();
    let xmax = drawn.iter().map(|c| log2(c.bytes)).fold(0.0, f64::max).ceil().max(xmin + 1.0);
    let ymax = drawn.iter().map(|c| c.busbw).fold(0.0, f64::max) * 1.1 + 1e-3;
    let ops: Vec<&str> = {
        let mut o: Vec<&str> = drawn.iter().map(|c| c.op.as_str()).collect();
        o.dedup();
        o
    };
    let host = ferrogloo::device::host_id();
    let host = host.split('/').next().unwrap_or("");
    let iters = drawn.iter().map(|c| c.iters).min().unwrap_or(0);
    let title = format!(
        "{}: {} {}, {n} ranks, ≥{iters} iterations per point, host {host}",
        ops.join(", "),
        args.dtype,
        args.reduce
    );
    let root = SVGBackend::new(path, (1100, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    // The chart on the left, the legend in a column of its own on the right.
    let (chart_area, legend_area) = root.split_horizontally(860);
    let mut chart = ChartBuilder::on(&chart_area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(xmin..xmax, 0.0..ymax)?;
    let ticks = (xmax - xmin) as usize;
    let step = ticks.div_ceil(12).max(1);
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc("bus bandwidth (GB/s)")
        .x_labels(ticks / step + 1)
        .x_label_formatter(&|x| if x.fract() == 0.0 { human(2f64.powf(*x) as usize) } else { String::new() })
        .draw()?;
    // One series per collective and algorithm asked for.
    struct Series {
        name: String,
        /// The collective's marker.
        shape: usize,
        pts: Vec<(f64, f64)>,
    }
    let mut series: Vec<Series> = Vec::new();
    for c in &drawn {
        let name =
            if ops.len() > 1 { format!("{} {}", c.op, c.algorithm.name()) } else { c.algorithm.name().to_string() };
        let shape = ops.iter().position(|o| *o == c.op).unwrap_or(0);
        let pt = (log2(c.bytes), c.busbw);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.pts.push(pt),
            None => series.push(Series { name, shape, pts: vec![pt] }),
        }
    }
    for (i, Series { name, shape, mut pts }) in series.into_iter().enumerate() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (r, g, b) = COLOURS[i % COLOURS.len()];
        let colour = RGBColor(r, g, b);
        chart.draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))?;
        let marker = |p: (f64, f64)| -> DynElement<'static, SVGBackend<'_>, (f64, f64)> {
            match shape % 3 {
                0 => Circle::new(p, 4, colour.filled()).into_dyn(),
                1 => TriangleMarker::new(p, 5, colour.filled()).into_dyn(),
                _ => Cross::new(p, 4, colour.stroke_width(2)).into_dyn(),
            }
        };
        chart.draw_series(pts.into_iter().map(marker))?;
        let y = 60 + 26 * i as i32;
        legend_area.draw(&PathElement::new(vec![(10, y), (40, y)], colour.stroke_width(3)))?;
        let mark: DynElement<'static, SVGBackend<'_>, (i32, i32)> = match shape % 3 {
            0 => Circle::new((25, y), 4, colour.filled()).into_dyn(),
            1 => TriangleMarker::new((25, y), 5, colour.filled()).into_dyn(),
            _ => Cross::new((25, y), 4, colour.stroke_width(2)).into_dyn(),
        };
        legend_area.draw(&mark)?;
        legend_area.draw(&Text::new(name, (48, y - 8), ("sans-serif", 15)))?;
    }
    root.present()?;
    Ok(())
}
