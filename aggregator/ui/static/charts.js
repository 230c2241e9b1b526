// Charts of the dashboard, drawn by Chart.js (static/vendor, loaded before this module).
// Bars carry their 95% intervals as whiskers (the ``whiskers`` plugin below); series
// show the estimate with its interval as a band, and the reports per step as bars. Every
// axis has a title (with the metric's unit where it has one); a chart with nothing to
// show gives way to a short message in its place (``placeholder``).

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
  const ends = intervals ? intervals.flat() : [];
  return replace(canvas, {
    type: "bar",
    data: {
      labels,
      datasets: [{ label, data: values, intervals, backgroundColor: color || COLORS.bar }],
    },
    options: {
      scales: {
        y: {
          suggestedMin: Math.min(0, ...ends, ...values),
          suggestedMax: Math.max(...ends, ...values),
          // Room above the highest whisker, so that its cap is never clipped at the edge.
          grace: "5%",
          title: titled(yTitle),
          ticks: { callback: (value) => (tick || format)(value) },
        },
        x: { title: titled(xTitle), ticks: { autoSkip: true, maxRotation: 40 } },
      },
      plugins: {
        legend: { display: false },
        tooltip: {
          callbacks: {
            label: (item) => {
              const interval = item.dataset.intervals?.[item.dataIndex];
              const text = label + ": " + format(item.raw);
              return interval
                ? text + "  (95% CI " + format(interval[0]) + " to " + format(interval[1]) + ")"
                : text;
            },
          },
        },
      },
    },
    plugins: [whiskers],
  });
}

/** Show a point only where the line has no neighbour to join (a step between gaps). */
function loneSteps(context) {
  const data = context.dataset.data;
  const i = context.dataIndex;
  const alone = (data[i - 1] ?? null) === null && (data[i + 1] ?? null) === null;
  return data[i] !== null && alone ? 3 : 0;
}

/**
 * The estimate per step (``values``, null where a step has none) with its 95% band
 * (``lows``, ``highs``); gaps stay gaps, and a step alone between gaps, which a band
 * cannot show, gets a whisker. ``yTitle`` names the value axis.
 */
export function bandChart(canvas, { labels, values, lows, highs, label, format, tick, yTitle }) {
  const lone = values.map(
    (value, i) =>
      value !== null && (values[i - 1] ?? null) === null && (values[i + 1] ?? null) === null,
  );
  const intervals = lone.map((alone, i) => (alone ? [lows[i], highs[i]] : null));
  return replace(canvas, {
    type: "line",
    data: {
      labels,
      datasets: [
        { label: "95% low", data: lows, borderWidth: 0, pointRadius: 0, fill: false },
        {
          label: "95% interval",
          data: highs,
          borderWidth: 0,
          pointRadius: 0,
          fill: "-1",
          backgroundColor: COLORS.band,
        },
        {
          label,
          data: values,
          intervals,
          borderColor: COLORS.line,
          backgroundColor: COLORS.line,
          borderWidth: 2,
          pointRadius: loneSteps,
          fill: false,
        },
      ],
    },
    options: {
      spanGaps: false,
      interaction: { mode: "index", intersect: false },
      scales: {
        // Offset as the bars of the reports' chart below, so that the steps line up.
        x: { ...TIME_AXIS, offset: true },
        y: {
          afterFit: alignedAxis,
          title: titled(yTitle),
          ticks: { callback: (value) => (tick || format)(value) },
        },
      },
      plugins: {
        legend: { labels: { filter: (item) => item.text !== "95% low" } },
        tooltip: {
          filter: (item) => item.datasetIndex === 2,
          callbacks: {
            label: (item) => {
              const low = lows[item.dataIndex];
              const high = highs[item.dataIndex];
              return (
                label +
                ": " +
                format(item.raw) +
                "  (95% CI " +
                format(low) +
                " to " +
                format(high) +
                ")"
              );
            },
          },
        },
      },
    },
    plugins: [whiskers],
  });
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
