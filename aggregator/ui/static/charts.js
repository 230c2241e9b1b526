// Charts of the dashboard, drawn by Chart.js (static/vendor, loaded before this module).
// Bars carry their 95% intervals as whiskers (the ``whiskers`` plugin below); series
// show the estimate with its interval as a band, and the reports per step as bars.

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

/** One width for the value axes of charts drawn one above the other, so their steps align. */
function alignedAxis(scale) {
  scale.width = 76;
}

function replace(canvas, config) {
  Chart.getChart(canvas)?.destroy();
  return new Chart(canvas, config);
}

/**
 * Bars of ``values`` at ``labels``; with ``intervals`` ([low, high] per bar) each bar gets
 * a whisker. ``format`` writes a value for the axis and the tooltips.
 */
export function barChart(canvas, { labels, values, intervals, label, format, tick, color }) {
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
          ticks: { callback: (value) => (tick || format)(value) },
        },
        x: { ticks: { autoSkip: true, maxRotation: 40 } },
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
 * cannot show, gets a whisker.
 */
export function bandChart(canvas, { labels, values, lows, highs, label, format, tick }) {
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
        x: {
          offset: true,
          ticks: { autoSkip: true, maxTicksLimit: 10, maxRotation: 0, sampleSize: 24 },
        },
        y: { afterFit: alignedAxis, ticks: { callback: (value) => (tick || format)(value) } },
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

/** Several lines over the same steps (``series``: [{label, values}]), no band. */
export function linesChart(canvas, { labels, series, format, axes }) {
  const scales = {
    x: { ticks: { autoSkip: true, maxTicksLimit: 10, maxRotation: 0, sampleSize: 24 } },
  };
  for (const [id, { format: tick, ...options }] of Object.entries(axes || { y: {} })) {
    scales[id] = { ...options, ticks: { callback: (value) => (tick || format)(value) } };
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
        borderDash: line.dashed ? [6, 4] : undefined,
        borderWidth: 2,
        pointRadius: labels.length > 60 ? 0 : 2,
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
        x: {
          stacked: true,
          ticks: { autoSkip: true, maxTicksLimit: 10, maxRotation: 0, sampleSize: 24 },
        },
        y: {
          stacked: true,
          beginAtZero: true,
          afterFit: alignedAxis,
          ticks: { precision: 0 },
          title: { display: true, text: "n" },
        },
      },
      plugins: { legend: { position: "bottom" } },
    },
  });
}
