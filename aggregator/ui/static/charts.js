// Charts of the dashboard, drawn by Chart.js (static/vendor, loaded before this module).
// Bars carry their 95% intervals as whiskers (the ``whiskers`` plugin below); series
// show the estimate with its interval as a band (one band per line when several
// quantiles are drawn), and the reports per step as bars. A distribution's histogram has
// its bars on a value axis (logarithmic for a log-scale metric) and its quantiles marked
// as lines with their intervals shaded (the ``markers`` plugin). Every axis has a title
// (with the metric's unit where it has one); a chart with nothing to show gives way to a
// short message in its place (``placeholder``).

const Chart = window.Chart;
Chart.defaults.animation = false;
Chart.defaults.maintainAspectRatio = false;
Chart.defaults.color = "#374151";
Chart.defaults.font.family = getComputedStyle(document.body).fontFamily;

export const COLORS = {
  bar: "#4c78a8",
  postprocessed: "#72b7b2",
  whisker: "#111827",
  line: "#1d4ed8",
  band: "rgba(59, 130, 246, 0.22)",
  released: "#4c78a8",
  suppressed: "#f58518",
  palette: ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#9d755d"],
};

/**
 * Draws the interval of each bar or point that has one (dataset.intervals[i] = [low, high],
 * or null) as a whisker with caps.
 */
const whiskers = {
  id: "whiskers",
  afterDatasetsDraw(chart) {
    const { ctx, chartArea, scales } = chart;
    chart.data.datasets.forEach((dataset, index) => {
      if (!dataset.intervals || !chart.isDatasetVisible(index)) return;
      ctx.save();
      ctx.beginPath();
      ctx.rect(chartArea.left, chartArea.top, chartArea.width, chartArea.height);
      ctx.clip();
      ctx.strokeStyle = COLORS.whisker;
      ctx.lineWidth = 2;
      chart.getDatasetMeta(index).data.forEach((bar, i) => {
        if (!dataset.intervals[i]) return;
        const [low, high] = dataset.intervals[i];
        const top = scales.y.getPixelForValue(high);
        const bottom = scales.y.getPixelForValue(low);
        const half = bar.width ? Math.max(3, Math.min(10, bar.width / 4)) : 4;
        ctx.beginPath();
        ctx.moveTo(bar.x, top);
        ctx.lineTo(bar.x, bottom);
        ctx.moveTo(bar.x - half, top);
        ctx.lineTo(bar.x + half, top);
        ctx.moveTo(bar.x - half, bottom);
        ctx.lineTo(bar.x + half, bottom);
        ctx.stroke();
      });
      ctx.restore();
    });
  },
};

/**
 * Draws each dataset marked ``level`` (a constant, such as a budget) as a dashed line
 * across the whole plot, so that it shows as a line even over a single step.
 */
const levels = {
  id: "levels",
  afterDatasetsDraw(chart) {
    const { ctx, chartArea, scales } = chart;
    chart.data.datasets.forEach((dataset, index) => {
      if (!dataset.level || !chart.isDatasetVisible(index)) return;
      const y = scales[dataset.yAxisID].getPixelForValue(dataset.data[0]);
      ctx.save();
      ctx.strokeStyle = dataset.borderColor;
      ctx.lineWidth = 2;
      ctx.setLineDash([6, 4]);
      ctx.beginPath();
      ctx.moveTo(chartArea.left, y);
      ctx.lineTo(chartArea.right, y);
      ctx.stroke();
      ctx.restore();
    });
  },
};

/** The height of one row of a marker's label, in pixels. */
const MARKER_ROW = 15;

/**
 * Marks values on the x axis (``options.plugins.markers.items``: [{value, low, high,
 * label, color}], in axis units): each interval [low, high] shaded across the plot behind
 * the datasets, each value a vertical line over them, labelled at the top (one row per
 * marker, so that close values keep legible labels).
 */
const markers = {
  id: "markers",
  beforeDatasetsDraw(chart, _args, options) {
    const { ctx, chartArea, scales } = chart;
    ctx.save();
    for (const item of options.items || []) {
      const left = Math.max(chartArea.left, scales.x.getPixelForValue(item.low));
      const right = Math.min(chartArea.right, scales.x.getPixelForValue(item.high));
      ctx.fillStyle = translucent(item.color, 0.12);
      ctx.fillRect(left, chartArea.top, Math.max(1, right - left), chartArea.height);
    }
    ctx.restore();
  },
  afterDatasetsDraw(chart, _args, options) {
    const { ctx, chartArea, scales } = chart;
    ctx.save();
    ctx.lineWidth = 2;
    ctx.font = "600 12px " + Chart.defaults.font.family;
    ctx.textBaseline = "middle";
    (options.items || []).forEach((item, row) => {
      const x = scales.x.getPixelForValue(item.value);
      ctx.strokeStyle = item.color;
      ctx.fillStyle = item.color;
      ctx.beginPath();
      ctx.moveTo(x, chartArea.top);
      ctx.lineTo(x, chartArea.bottom);
      ctx.stroke();
      // Beside the line, on the side with room for the text.
      const room = chartArea.right - x > ctx.measureText(item.label).width + 8;
      ctx.textAlign = room ? "left" : "right";
      ctx.fillText(item.label, x + (room ? 4 : -4), chartArea.top + MARKER_ROW * (row + 0.5));
    });
    ctx.restore();
  },
};

/** ``#rrggbb`` with an opacity: "rgba(r, g, b, alpha)". */
function translucent(color, alpha) {
  const [r, g, b] = [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
  return "rgba(" + r + ", " + g + ", " + b + ", " + alpha + ")";
}

/** A value with its 95% interval, as the tooltips write it. */
function withInterval(text, format, interval) {
  return interval
    ? text + "  (95% CI " + format(interval[0]) + " to " + format(interval[1]) + ")"
    : text;
}

/**
 * The ticks of a logarithmic axis: only the values 1, 2 and 5 times a power of ten are
 * written (the others are left blank), so that labels never crowd.
 */
function logTick(format) {
  return (value) => {
    const mantissa = value / 10 ** Math.floor(Math.log10(value) + 1e-9);
    return [1, 2, 5].some((shown) => Math.abs(mantissa - shown) < 1e-6) ? format(value) : "";
  };
}

/**
 * A value axis of shares (``values`` and the ``intervals`` drawn on it all in view, with
 * room above the highest whisker so that its cap is never clipped at the edge).
 */
function shareAxis({ values, intervals, title, format, tick }) {
  const ends = intervals ? intervals.flat() : [];
  return {
    suggestedMin: Math.min(0, ...ends, ...values),
    suggestedMax: Math.max(...ends, ...values),
    grace: "5%",
    title: titled(title),
    ticks: { callback: (value) => (tick || format)(value) },
  };
}

/** One width for the value axes of charts drawn one above the other, so their steps align. */
function alignedAxis(scale) {
  scale.width = 76;
}

/** An axis title: what the axis measures, with its unit. */
function titled(text) {
  return { display: true, text, font: { weight: "600" } };
}

/** The time axis of a series, in steps: its title and its ticks. */
const TIME_AXIS = {
  title: titled("time (UTC)"),
  ticks: { autoSkip: true, maxTicksLimit: 10, maxRotation: 0, sampleSize: 24 },
};

/** The message element of a chart's box, made the first time it is needed. */
function placeholderOf(canvas) {
  const box = canvas.parentElement;
  let message = box.querySelector(".chart-placeholder");
  if (!message) {
    message = document.createElement("p");
    message.className = "chart-placeholder";
    message.setAttribute("role", "status");
    message.hidden = true;
    box.append(message);
  }
  return message;
}

/**
 * Put ``text`` (e.g. "No reports in this window yet") where the chart on ``canvas`` would
 * be, instead of an empty chart; drawing a chart on it again removes the message.
 */
export function placeholder(canvas, text) {
  Chart.getChart(canvas)?.destroy();
  canvas.hidden = true;
  const message = placeholderOf(canvas);
  message.textContent = text;
  message.hidden = false;
}

function replace(canvas, config) {
  Chart.getChart(canvas)?.destroy();
  canvas.hidden = false;
  const message = canvas.parentElement.querySelector(".chart-placeholder");
  if (message) message.hidden = true;
  return new Chart(canvas, config);
}

/**
 * Bars of ``values`` at ``labels``; with ``intervals`` ([low, high] per bar) each bar gets
 * a whisker. ``format`` writes a value for the axis and the tooltips; ``xTitle`` and
 * ``yTitle`` name the axes.
 */
export function barChart(
  canvas,
  { labels, values, intervals, label, format, tick, color, xTitle, yTitle },
) {
  return replace(canvas, {
    type: "bar",
    data: {
      labels,
      datasets: [{ label, data: values, intervals, backgroundColor: color || COLORS.bar }],
    },
    options: {
      scales: {
        y: shareAxis({ values, intervals, title: yTitle, format, tick }),
        x: { title: titled(xTitle), ticks: { autoSkip: true, maxRotation: 40 } },
      },
      plugins: {
        legend: { display: false },
        tooltip: {
          callbacks: {
            label: (item) =>
              withInterval(
                label + ": " + format(item.raw),
                format,
                item.dataset.intervals?.[item.dataIndex],
              ),
          },
        },
      },
    },
    plugins: [whiskers],
  });
}

/**
 * A histogram on a value axis: a bar per bucket (``buckets``: [{low, high}], in value
 * units; ``values`` their post-processed shares) spanning its bucket (a logarithmic axis
 * when ``logarithmic``, on which buckets of equal ratio are equally wide), with the
 * unbiased share of each bucket (``estimates``) as a point and its 95% interval
 * (``intervals``) as a whisker, and the ``marked`` values (quantiles: [{value, low,
 * high, label, color}]) as lines with their intervals shaded. ``format`` and ``tick``
 * write a share, ``valueTick`` a value on the axis, ``bucketLabel`` a bucket in the
 * tooltips; ``xTitle`` and ``yTitle`` name the axes.
 */
export function histogramChart(
  canvas,
  {
    buckets,
    values,
    estimates,
    intervals,
    logarithmic,
    marked,
    format,
    tick,
    valueTick,
    bucketLabel,
    xTitle,
    yTitle,
  },
) {
  // The middle of a bucket on its axis: by ratio on a logarithmic one.
  const middle = logarithmic
    ? (bucket) => Math.sqrt(bucket.low * bucket.high)
    : (bucket) => (bucket.low + bucket.high) / 2;
  const placed = (shares) => shares.map((y, i) => ({ x: middle(buckets[i]), y }));
  return replace(canvas, {
    type: "bar",
    data: {
      datasets: [
        {
          label: "post-processed share",
          data: placed(values),
          intervals,
          backgroundColor: COLORS.postprocessed,
          // Each bar as wide as the space between its neighbours' middles: its bucket.
          barThickness: "flex",
          categoryPercentage: 1,
          barPercentage: 1,
          order: 1, // drawn before the points
        },
        {
          type: "line",
          label: "unbiased share, 95% interval",
          data: placed(estimates),
          showLine: false,
          pointRadius: 2.5,
          borderColor: COLORS.whisker,
          backgroundColor: COLORS.whisker,
        },
      ],
    },
    options: {
      interaction: { mode: "index", axis: "x", intersect: false },
      scales: {
        x: {
          type: logarithmic ? "logarithmic" : "linear",
          min: buckets[0].low,
          max: buckets[buckets.length - 1].high,
          offset: false,
          grid: { offset: false },
          title: titled(xTitle),
          ticks: {
            callback: logarithmic ? logTick(valueTick) : valueTick,
            autoSkip: !logarithmic,
            maxRotation: 0,
          },
        },
        y: shareAxis({
          values: [...values, ...estimates],
          intervals,
          title: yTitle,
          format,
          tick,
        }),
      },
      plugins: {
        markers: { items: marked },
        tooltip: {
          callbacks: {
            title: (items) => bucketLabel(buckets[items[0].dataIndex]),
            label: (item) =>
              item.datasetIndex === 0
                ? "post-processed share: " + format(item.raw.y)
                : withInterval(
                    "unbiased share: " + format(item.raw.y),
                    format,
                    intervals[item.dataIndex],
                  ),
          },
        },
      },
    },
    plugins: [markers, whiskers],
  });
}

/** Whether step ``i`` of ``values`` has a value and no neighbour with one. */
function alone(values, i) {
  return values[i] !== null && (values[i - 1] ?? null) === null && (values[i + 1] ?? null) === null;
}

/** Show a point only where the line has no neighbour to join (a step between gaps). */
function loneSteps(context) {
  return alone(context.dataset.data, context.dataIndex) ? 3 : 0;
}

/**
 * The datasets of one line with its band: the band's low and high edges (the high one
 * filled down to the low), then the line, which keeps its ``lows`` and ``highs`` for
 * the tooltips and, at a step alone between gaps that a band cannot show, a whisker.
 */
function bandedLine({ label, values, lows, highs, color, band }, bandLabel) {
  const intervals = values.map((_, i) => (alone(values, i) ? [lows[i], highs[i]] : null));
  const edge = { borderWidth: 0, pointRadius: 0, band: true };
  return [
    { ...edge, label: label + ": 95% low", data: lows, fill: false },
    { ...edge, label: bandLabel, data: highs, fill: "-1", backgroundColor: band },
    {
      label,
      data: values,
      intervals,
      lows,
      highs,
      borderColor: color,
      backgroundColor: color,
      borderWidth: 2,
      pointRadius: loneSteps,
      fill: false,
    },
  ];
}

/**
 * Lines per step (``lines``: [{label, values, lows, highs}], values null where a step
 * has none), each with its 95% band (from ``lows`` to ``highs``); gaps stay gaps, and a
 * step alone between gaps, which a band cannot show, gets a whisker. A line takes its
 * ``color`` (by default the dashboard's line colour when it is alone, the palette's when
 * there are several). One line's band has a legend entry of its own; of several lines,
 * the legend names the lines only (each band is in its line's colour). ``yTitle`` names
 * the value axis, ``logarithmic`` makes it logarithmic.
 */
export function bandsChart(canvas, { labels, lines, format, tick, yTitle, logarithmic }) {
  const single = lines.length === 1;
  const datasets = lines.flatMap((line, index) => {
    const color =
      line.color || (single ? COLORS.line : COLORS.palette[index % COLORS.palette.length]);
    const band = single ? COLORS.band : translucent(color, 0.2);
    const bandLabel = single ? "95% interval" : line.label + ": 95% interval";
    return bandedLine({ ...line, color, band }, bandLabel);
  });
  const shown = (dataset) => !dataset.band || (single && dataset.fill);
  const axisTick = (value) => (tick || format)(value);
  return replace(canvas, {
    type: "line",
    data: { labels, datasets },
    options: {
      spanGaps: false,
      interaction: { mode: "index", intersect: false },
      scales: {
        // Offset as the bars of the reports' chart below, so that the steps line up.
        x: { ...TIME_AXIS, offset: true },
        y: {
          type: logarithmic ? "logarithmic" : "linear",
          afterFit: alignedAxis,
          title: titled(yTitle),
          // A logarithmic axis keeps every tick: those not written are blank.
          ticks: { callback: logarithmic ? logTick(axisTick) : axisTick, autoSkip: !logarithmic },
        },
      },
      plugins: {
        legend: { labels: { filter: (item) => shown(datasets[item.datasetIndex]) } },
        tooltip: {
          filter: (item) => !item.dataset.band,
          callbacks: {
            label: (item) =>
              withInterval(item.dataset.label + ": " + format(item.raw), format, [
                item.dataset.lows[item.dataIndex],
                item.dataset.highs[item.dataIndex],
              ]),
          },
        },
      },
    },
    plugins: [whiskers],
  });
}

/**
 * The estimate per step (``values``, null where a step has none) with its 95% band
 * (``lows``, ``highs``): ``bandsChart`` with one line named ``label``.
 */
export function bandChart(canvas, { labels, values, lows, highs, label, format, tick, yTitle }) {
  const lines = [{ label, values, lows, highs }];
  return bandsChart(canvas, { labels, lines, format, tick, yTitle });
}

/**
 * Several lines over the same steps (``series``: [{label, values}]; ``level: true`` for a
 * constant drawn across the plot), no band. ``xTitle`` names the steps; ``axes`` holds
 * the value axes' options by id, each with its ``title`` (text) and an optional
 * ``format`` of its ticks.
 */
export function linesChart(canvas, { labels, series, format, xTitle, axes }) {
  const scales = {
    x: {
      // Half a step at each end: a lone first step is not drawn on the axis itself.
      offset: true,
      title: titled(xTitle),
      ticks: { autoSkip: true, maxTicksLimit: 10, maxRotation: 0, sampleSize: 24 },
    },
  };
  for (const [id, { format: tick, title, ...options }] of Object.entries(axes)) {
    scales[id] = {
      ...options,
      title: titled(title),
      ticks: { callback: (value) => (tick || format)(value) },
    };
  }
  return replace(canvas, {
    type: "line",
    data: {
      labels,
      datasets: series.map((line, index) => ({
        label: line.label,
        data: line.values,
        yAxisID: line.axis || "y",
        borderColor: line.color || COLORS.palette[index % COLORS.palette.length],
        backgroundColor: line.color || COLORS.palette[index % COLORS.palette.length],
        borderDash: line.level ? [6, 4] : undefined, // in the legend as on the plot
        borderWidth: 2,
        pointRadius: line.level || labels.length > 60 ? 0 : 3,
        showLine: !line.level,
        level: line.level,
        spanGaps: false,
      })),
    },
    options: {
      interaction: { mode: "index", intersect: false },
      scales,
      plugins: {
        legend: { display: series.length > 1 },
        tooltip: {
          callbacks: { label: (item) => item.dataset.label + ": " + format(item.raw) },
        },
      },
    },
    plugins: [levels],
  });
}

/**
 * Reports per step, stacked: steps whose estimate was released, and steps below the
 * release threshold (no estimate).
 */
export function countChart(canvas, { labels, released, suppressed }) {
  return replace(canvas, {
    type: "bar",
    data: {
      labels,
      datasets: [
        { label: "reports (estimate released)", data: released, backgroundColor: COLORS.released },
        {
          label: "reports (below the release threshold: no estimate)",
          data: suppressed,
          backgroundColor: COLORS.suppressed,
        },
      ],
    },
    options: {
      scales: {
        x: { ...TIME_AXIS, stacked: true },
        y: {
          stacked: true,
          beginAtZero: true,
          afterFit: alignedAxis,
          ticks: { precision: 0 },
          title: titled("reports"),
        },
      },
      plugins: { legend: { position: "bottom" } },
    },
  });
}

/**
 * Bars in groups: at each of ``labels`` one bar per entry of ``groups`` ([{label, values,
 * intervals, color}], ``values`` one per label, ``intervals`` [low, high] per label or
 * null), each with its whisker; the legend names the groups. ``format`` writes a value
 * for the tooltips, ``tick`` on the axis; ``xTitle`` and ``yTitle`` name the axes. With
 * ``floor`` and ``ceiling`` (positive values) the value axis is logarithmic between them,
 * the bars rising from the floor.
 */
export function groupedBarChart(
  canvas,
  { labels, groups, format, tick, xTitle, yTitle, floor, ceiling },
) {
  const values = groups.flatMap((group) => group.values.filter((v) => v !== null));
  const intervals = groups.flatMap((group) => (group.intervals || []).filter(Boolean));
  const axisTick = (value) => (tick || format)(value);
  const y = floor
    ? {
        type: "logarithmic",
        min: floor,
        max: ceiling,
        title: titled(yTitle),
        ticks: { callback: logTick(axisTick), autoSkip: false },
      }
    : shareAxis({ values, intervals, title: yTitle, format, tick });
  return replace(canvas, {
    type: "bar",
    data: {
      labels,
      datasets: groups.map((group, index) => ({
        label: group.label,
        data: group.values,
        intervals: group.intervals,
        backgroundColor: group.color || COLORS.palette[index % COLORS.palette.length],
      })),
    },
    options: {
      scales: {
        y,
        x: { title: titled(xTitle), ticks: { autoSkip: true, maxRotation: 40 } },
      },
      plugins: {
        legend: { display: groups.length > 1, position: "bottom" },
        tooltip: {
          callbacks: {
            label: (item) =>
              withInterval(
                item.dataset.label + ": " + format(item.raw),
                format,
                item.dataset.intervals?.[item.dataIndex],
              ),
          },
        },
      },
    },
    plugins: [whiskers],
  });
}
