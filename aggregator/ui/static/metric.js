// One metric's page: with the analyst key, the estimate over the chosen window and the
// series of that window (GET /v1/metrics/{name}/estimate and /series; heavy hitters for
// the discovery mechanisms). A distribution metric shows its histogram with the quantiles
// marked, a table of the quantiles, the share of a range of values asked in a form, and
// its quantiles over time. A metric with dimensions can be broken down by one of them and
// filtered by each (breakdown.js); a multi-attribute metric shows each attribute and the
// joint distribution of each declared pair (attributes.js).
import {
  api,
  count,
  el,
  explain,
  fillRows,
  number,
  onKeyChange,
  percent,
  percentInterval,
  percentTick,
  say,
  titleWithUnit,
  utc,
  withUnit,
} from "./common.js";
import {
  COLORS,
  bandChart,
  bandsChart,
  barChart,
  countChart,
  histogramChart,
  placeholder,
} from "./charts.js";
import {
  chosenBreakdown,
  hasDimensions,
  onBreakdownChange,
  rememberBreakdown,
  restoreBreakdown,
  showGroups,
} from "./breakdown.js";
import { attributeItems, attributePoint, clearAttributes, showAttributes } from "./attributes.js";

const root = document.getElementById("metric");
const metric = {
  name: root.dataset.name,
  version: Number(root.dataset.version),
  kind: root.dataset.kind,
  mechanism: root.dataset.mechanism,
  labeled: root.dataset.labeled === "true",
  unit: root.dataset.unit || null,
  discovers: root.dataset.mechanism === "pem" || root.dataset.mechanism === "sfp",
  distribution: root.dataset.kind === "distribution",
  attributes: root.dataset.kind === "attributes",
};
// The quantiles a distribution metric's page asks for, and the colour of each one's marks.
const QUANTILES = [0.5, 0.95, 0.99];
const QUANTILE_COLORS = [COLORS.palette[3], COLORS.palette[1], COLORS.palette[5]];
const path = "/v1/metrics/" + encodeURIComponent(metric.name);
const HOUR = 3600e3;
const DAY = 24 * HOUR;
const SPANS = { "24h": DAY, "7d": 7 * DAY, "30d": 30 * DAY, "90d": 90 * DAY };
// Windows up to this long are shown in hourly steps when the step is automatic.
const HOURLY_UP_TO = 7 * DAY;

const form = document.getElementById("window-form");
const preset = document.getElementById("window-preset");
const stepChoice = document.getElementById("window-step");
const customRange = document.getElementById("custom-range");
const customStart = document.getElementById("window-start");
const customEnd = document.getElementById("window-end");
const itemChoice = document.getElementById("series-item");
const postprocessedToggle = document.getElementById("show-postprocessed");
const rangeForm = document.getElementById("range-form");

let generation = 0; // answers to an earlier choice of window are dropped
let shownEstimate = null;
let shownSeries = null;
let pickedItem = null; // the series item the user chose, kept across windows
let shownParams = null; // the window of the estimate shown: a range is asked over it
let askedRange = null; // the range of values [low, high] last asked for, kept across windows

// --- the window ----------------------------------------------------------------------------

function floorTo(ms, unit) {
  return Math.floor(ms / unit) * unit;
}

function ceilTo(ms, unit) {
  return Math.ceil(ms / unit) * unit;
}

/** "2026-11-22T10:00" for a datetime-local input (shown and read as UTC). */
function localInput(ms) {
  return new Date(ms).toISOString().slice(0, 16);
}

/** A datetime-local input's value read as UTC (NaN when it is not a time). */
function utcInput(value) {
  return Date.parse(value + (value.length === 16 ? ":00Z" : "Z"));
}

function isoTime(ms) {
  return new Date(ms).toISOString().replace(".000Z", "Z");
}

/** The end of the current UTC hour: reports carry their hour, so none is later. */
function currentHourEnd() {
  return ceilTo(Date.now() + 1, HOUR);
}

/**
 * The chosen window, on the grid of its step: ``{start, end, step}`` (milliseconds).
 * Presets end with the current hour; a range is widened to whole steps, as the series
 * endpoint widens it, but never past the current hour's end (a custom end typed later
 * than that is kept as typed): a window of daily steps ends now, not at midnight.
 */
function chosenWindow() {
  let start;
  let end;
  if (preset.value === "custom") {
    start = utcInput(customStart.value);
    end = utcInput(customEnd.value);
    if (!(start < end)) return null;
  } else {
    end = currentHourEnd();
    start = end - SPANS[preset.value];
  }
  let step = stepChoice.value;
  if (step === "auto") step = end - start <= HOURLY_UP_TO ? "1h" : "1d";
  const unit = step === "1h" ? HOUR : DAY;
  const widened = Math.min(ceilTo(end, unit), Math.max(end, currentHourEnd()));
  return { start: floorTo(start, unit), end: widened, step };
}

/** The window's choice in the page's address (never the key), so a reload keeps it. */
function remember() {
  const query = new URLSearchParams(location.search);
  query.set("window", preset.value);
  query.set("step", stepChoice.value);
  if (preset.value === "custom") {
    query.set("from", customStart.value);
    query.set("to", customEnd.value);
  } else {
    query.delete("from");
    query.delete("to");
  }
  rememberBreakdown(query);
  history.replaceState(null, "", "?" + query);
}

function restore() {
  const query = new URLSearchParams(location.search);
  const windowChoice = query.get("window");
  if (windowChoice && (windowChoice in SPANS || windowChoice === "custom"))
    preset.value = windowChoice;
  const step = query.get("step");
  if (["auto", "1h", "1d"].includes(step)) stepChoice.value = step;
  customStart.value = query.get("from") || localInput(Date.now() - DAY);
  customEnd.value = query.get("to") || localInput(ceilTo(Date.now(), HOUR));
  customRange.hidden = preset.value !== "custom";
  restoreBreakdown(query);
}

// --- loading -------------------------------------------------------------------------------

async function load() {
  const chosen = chosenWindow();
  if (!chosen) {
    say("window-summary", "The window's start must be before its end.", "error");
    return;
  }
  remember();
  const mine = ++generation;
  root.setAttribute("aria-busy", "true"); // until this window's answers are all shown
  const hourly = chosen.step === "1h";
  document.getElementById("window-summary").textContent =
    "Window " +
    utc(chosen.start) +
    " to " +
    utc(chosen.end) +
    " UTC, in steps of one " +
    (hourly ? "hour" : "day") +
    (metric.version ? " · version " + metric.version : "");
  const params = {
    start: isoTime(chosen.start),
    end: isoTime(chosen.end),
    version: metric.version,
    quantiles: metric.distribution ? QUANTILES.join(",") : undefined,
  };
  // The filters apply to the estimate and the series; the groups are the estimate's.
  const { by, where } = chosenBreakdown();
  if (where.length) params.where = where;
  if (metric.discovers) {
    // A discovery metric without candidate strings of its own is estimated, and drawn
    // over time, at the strings its reports reveal.
    const found = await loadHeavyHitters(params, mine);
    if (mine !== generation) return;
    if (!metric.labeled && found.length) params.candidates = found;
  }
  // Both answers are shown together: the series says whether the window holds any
  // report, which the estimate's refusal does not, and the series' default item is the
  // estimate's most frequent one.
  const [estimate, series] = await Promise.allSettled([
    api(path + "/estimate", { ...params, by }),
    api(path + "/series", { ...params, step: chosen.step }),
  ]);
  if (mine !== generation) return;
  const inWindow = series.status === "fulfilled" ? reportsIn(series.value) : null;
  shownParams = params;
  if (estimate.status === "fulfilled") showEstimate(estimate.value);
  else showNoEstimate(estimate.reason, inWindow);
  if (metric.distribution) showRangeOf(estimate.status === "fulfilled", mine);
  if (series.status === "fulfilled") showSeries(series.value);
  else showNoSeries(series.reason);
  root.removeAttribute("aria-busy");
}

/** The reports a series' steps hold, released or not. */
function reportsIn(series) {
  return series.steps.reduce((sum, step) => sum + step.n, 0);
}

// --- the estimate ----------------------------------------------------------------------------

/** "1 report", "12,000 reports". */
function reports(n) {
  return count(n) + (n === 1 ? " report" : " reports");
}

function categoryName(item) {
  return item.label ?? "#" + item.index;
}

/** What the release threshold counts: " time buckets", or of a metric with dimensions
 * " (time bucket, cell) units" (a cell: one combination of dimension values). */
function unitName(units) {
  const plural = units === 1 ? "" : "s";
  return hasDimensions ? " (time bucket, cell) unit" + plural : " time bucket" + plural;
}

/** The unit of the release threshold, in words: "time bucket" or "time bucket of a cell". */
function oneUnit() {
  return hasDimensions ? "time bucket of a cell" : "time bucket";
}

function showFacts(body) {
  const facts = [
    "n = " + reports(body.n) + " in " + body.buckets + unitName(body.buckets),
    "ε = " + number(body.epsilon),
  ];
  if (body.epsilon_report !== null && body.epsilon_report !== undefined) {
    facts.push("ε per report = " + number(body.epsilon_report));
  }
  if (body.resolved_mechanism && body.resolved_mechanism !== body.mechanism) {
    facts.push("mechanism " + body.mechanism + " → " + body.resolved_mechanism);
  }
  if (body.suppressed_buckets) {
    facts.push(
      reports(body.suppressed_reports) +
        " in " +
        body.suppressed_buckets +
        unitName(body.suppressed_buckets) +
        " below the release threshold of " +
        count(body.min_reports) +
        " left out",
    );
  }
  facts.push(...integrityFacts(body.integrity));
  document
    .getElementById("estimate-facts")
    .replaceChildren(...facts.map((text) => el("span", { className: "fact" }, text)));
}

/** The integrity facts of an estimate: its fit's p-value, and the reports refused. */
function integrityFacts(integrity) {
  if (!integrity) return [];
  const facts = [];
  if (integrity.fit) facts.push("honest-model fit p = " + pValue(integrity.fit.p_value));
  const refused = Object.values(integrity.refused).reduce((a, b) => a + b, 0);
  if (refused) {
    facts.push(
      reports(refused) + " refused (" + percent(integrity.refused_share) + " of those sent: " +
        Object.keys(integrity.refused).join(", ") + ")",
    );
  }
  return facts;
}

function pValue(p) {
  return p < 1e-4 ? p.toExponential(1) : number(p, 2);
}

/** The warning of an estimate whose reports do not look honest (integrity.alert). */
function showIntegrity(integrity) {
  const warning = document.getElementById("integrity-warning");
  const alert = Boolean(integrity && integrity.alert);
  warning.hidden = !alert;
  // The message names the test and its p-value.
  warning.textContent = alert ? "Warning: this estimate may be attacked: " + integrity.message + "." : "";
}

function showEstimate(body) {
  say("estimate-message", "");
  showEstimateParts(true);
  shownEstimate = body;
  showFacts(body);
  showIntegrity(body.integrity);
  if (body.kind === "categorical") showCategorical(body);
  else if (body.kind === "numeric") showMean(body);
  else if (body.kind === "distribution") showDistribution(body);
  else if (body.kind === "attributes") showAttributes(body);
  else showStrings(body);
  showGroups(body, {
    quantiles: QUANTILES,
    quantileName,
    quantileColors: QUANTILE_COLORS,
    unitTitle: (text) => titleWithUnit(text, metric.unit),
  });
}

function showEstimateParts(shown) {
  const parts = [
    "estimate-toggle",
    "estimate-table",
    "strings-table",
    "mean-summary",
    "quantile-table",
    "histogram-details",
    "range-section",
  ];
  for (const id of parts) {
    const part = document.getElementById(id);
    if (part) part.hidden = !shown;
  }
}

/**
 * No estimate: a window without reports says so in a word; one whose reports are too few
 * (409) or a refusal gives the service's reason. ``inWindow``: the reports the window
 * holds, when the series said (null when it did not answer).
 */
function showNoEstimate(error, inWindow) {
  shownEstimate = null;
  showEstimateParts(false);
  const empty = error.status === 409 && inWindow === 0;
  const short = empty
    ? "No reports in this window yet"
    : error.status === 409
      ? "Too few reports in this window for an estimate"
      : "No estimate for this window";
  const chart = document.getElementById("estimate-chart");
  if (chart) placeholder(chart, short);
  // The reason, unless the chart's placeholder already says all there is to say.
  say(
    "estimate-message",
    empty && chart ? "" : empty ? short + "." : short + ": " + explain(error),
    error.status === 409 ? "info" : "error",
  );
  document.getElementById("estimate-facts").replaceChildren();
  showIntegrity(null);
  for (const id of ["estimate-table", "strings-table", "quantile-table", "histogram-table"]) {
    const table = document.getElementById(id);
    if (table) table.tBodies[0].replaceChildren();
  }
  document.getElementById("mean-summary")?.replaceChildren();
  if (metric.attributes) clearAttributes();
  showGroups(null, {});
}

function drawBars(body) {
  const canvas = document.getElementById("estimate-chart");
  const labels = body.estimates.map(categoryName);
  if (postprocessedToggle.checked) {
    barChart(canvas, {
      labels,
      values: body.postprocessed.map((item) => item.frequency),
      label: "post-processed frequency",
      format: percent,
      tick: percentTick,
      color: COLORS.postprocessed,
      xTitle: "category",
      yTitle: "post-processed share of reports",
    });
  } else {
    barChart(canvas, {
      labels,
      values: body.estimates.map((item) => item.frequency),
      intervals: body.estimates.map((item) => [item.ci_low, item.ci_high]),
      label: "frequency",
      format: percent,
      tick: percentTick,
      xTitle: "category",
      yTitle: "share of reports (95% interval)",
    });
  }
}

function showCategorical(body) {
  drawBars(body);
  fillRows(
    document.getElementById("estimate-table").tBodies[0],
    body.estimates.map((item, i) => [
      categoryName(item),
      percent(item.frequency),
      percentInterval(item.ci_low, item.ci_high),
      percent(item.std),
      count(item.count),
      percent(body.postprocessed[i].frequency),
    ]),
  );
}

/** A mean's table: the users' own mean and the population's, each with its interval. */
function showMean(body) {
  const unit = metric.unit;
  const value = (x) => number(x, 5);
  const head = ["Mean of", "Estimate", "95% interval", "Std"].map((text, i) =>
    el("th", { scope: "col" }, i ? titleWithUnit(text, unit) : text),
  );
  const rows = [
    [
      "the reporting users",
      body.mean,
      body.ci_low,
      body.ci_high,
      body.std,
    ],
    [
      "the population they came from",
      body.mean,
      body.population_ci_low,
      body.population_ci_high,
      body.population_std,
    ],
  ];
  if (body.robust) {
    // Reports winsorized at the honest noise's quantiles: one report's reach is bounded;
    // the interval is widened by the bias bound.
    const robust = body.robust;
    rows.push([
      "the reporting users, robust (bias at most " + number(robust.bias_bound) + ")",
      robust.mean,
      robust.ci_low,
      robust.ci_high,
      robust.std,
    ]);
  }
  const table = el(
    "table",
    { id: "mean-table", className: "numbers" },
    el("thead", {}, el("tr", {}, head)),
    el("tbody"),
  );
  fillRows(
    table.tBodies[0],
    rows.map(([who, mean, low, high, std]) => [
      who,
      value(mean),
      value(low) + " to " + value(high), // "[1,169.6, 1,601]" would read as four numbers
      number(std),
    ]),
  );
  document
    .getElementById("mean-summary")
    .replaceChildren(
      el("div", { className: "mean-value" }, withUnit(value(body.mean), unit)),
      table,
      el(
        "p",
        { className: "muted small" },
        "Values clipped to [" +
          number(body.lower) +
          ", " +
          withUnit(number(body.upper) + "]", unit) +
          "; mean kept inside them (post-processed): " +
          withUnit(value(body.postprocessed_mean), unit) +
          "; the users' std is " +
          body.std_method +
          ".",
      ),
    );
}

function showStrings(body) {
  const items = [...body.candidates].sort((a, b) => b.frequency - a.frequency);
  fillRows(
    document.getElementById("strings-table").tBodies[0],
    items.map((item) => [
      el("td", { className: "string" }, item.string),
      percent(item.frequency),
      percentInterval(item.ci_low, item.ci_high),
      percent(item.std),
      count(item.count),
      item.detected === null || item.detected === undefined ? "–" : item.detected ? "yes" : "no",
    ]),
  );
  if (body.explained_mass !== null && body.explained_mass !== undefined) {
    document
      .getElementById("estimate-facts")
      .append(
        el("span", { className: "fact" }, "candidates explain " + percent(body.explained_mass)),
        el(
          "span",
          { className: "fact" },
          "detection limit " + percent(body.smallest_detectable_frequency),
        ),
      );
  }
}

// --- a distribution ----------------------------------------------------------------------------

/** A quantile's name: 0.5 -> "p50", 0.999 -> "p99.9". */
function quantileName(q) {
  return "p" + Number((q * 100).toPrecision(6));
}

/** A value of the metric with its unit: "231.4 ms". */
function valueText(value) {
  return withUnit(number(value), metric.unit);
}

/** Values from ``low`` to ``high``, with the unit once: "200 to 260 ms". */
function valuesFromTo(low, high) {
  return withUnit(number(low) + " to " + number(high), metric.unit);
}

/** The estimate's quantiles as the histogram marks them, each in its colour. */
function quantileMarks(quantiles) {
  return quantiles.map((item, i) => ({
    value: item.value,
    low: item.ci_low,
    high: item.ci_high,
    label: quantileName(item.q),
    color: QUANTILE_COLORS[i % QUANTILE_COLORS.length],
  }));
}

/** The histogram in words, for the chart's text alternative. */
function describeHistogram(body) {
  const quantiles = body.quantiles.map(
    (item) =>
      quantileName(item.q) +
      " " +
      valueText(item.value) +
      " (95% interval " +
      valuesFromTo(item.ci_low, item.ci_high) +
      ")",
  );
  return (
    "Histogram of the values in " +
    body.value_buckets +
    " buckets from " +
    valuesFromTo(body.lower, body.upper) +
    " (" +
    body.scale +
    " scale): the post-processed share of each bucket as a bar, its unbiased share as a " +
    "point with a 95% interval whisker; quantiles marked as lines with their intervals " +
    "shaded: " +
    quantiles.join(", ") +
    ". Every bucket is listed in the table of buckets below."
  );
}

function drawHistogram(body) {
  const canvas = document.getElementById("estimate-chart");
  histogramChart(canvas, {
    buckets: body.histogram,
    values: body.histogram.map((bucket) => bucket.postprocessed),
    estimates: body.histogram.map((bucket) => bucket.fraction),
    intervals: body.histogram.map((bucket) => [bucket.ci_low, bucket.ci_high]),
    logarithmic: body.scale === "log",
    marked: quantileMarks(body.quantiles),
    format: percent,
    tick: percentTick,
    valueTick: (value) => number(value),
    bucketLabel: (bucket) => valuesFromTo(bucket.low, bucket.high),
    xTitle: titleWithUnit("value", metric.unit) + (body.scale === "log" ? ", log scale" : ""),
    yTitle: "share of reports (95% interval)",
  });
  canvas.setAttribute("aria-label", describeHistogram(body));
}

/** A distribution: its histogram with the quantiles marked, the quantiles' table and the
 * buckets' table. */
function showDistribution(body) {
  drawHistogram(body);
  document
    .getElementById("estimate-facts")
    .append(
      el(
        "span",
        { className: "fact" },
        body.value_buckets +
          " buckets, " +
          body.scale +
          " scale, " +
          valuesFromTo(body.lower, body.upper),
      ),
      el("span", { className: "fact" }, "post-processed by " + body.method),
    );
  fillRows(
    document.getElementById("quantile-table").tBodies[0],
    body.quantiles.map((item) => [
      quantileName(item.q),
      number(item.value),
      number(item.ci_low) + " to " + number(item.ci_high),
    ]),
  );
  fillRows(
    document.getElementById("histogram-table").tBodies[0],
    body.histogram.map((bucket) => [
      number(bucket.low) + " to " + number(bucket.high),
      percent(bucket.postprocessed),
      percent(bucket.fraction),
      percentInterval(bucket.ci_low, bucket.ci_high),
    ]),
  );
}

/**
 * The share of the range last asked for, over the window of the estimate shown (none
 * when the window has no estimate). ``mine``: the window's load, whose answer is dropped
 * once another window is chosen.
 */
async function showRangeOf(hasEstimate, mine) {
  const result = document.getElementById("range-result");
  if (!askedRange || !hasEstimate) {
    result.hidden = true;
    say("range-message", "");
    return;
  }
  try {
    const body = await api(path + "/estimate", { ...shownParams, range: askedRange.join(",") });
    if (mine === generation) showRange(body.range);
  } catch (error) {
    if (mine !== generation) return;
    result.hidden = true;
    say("range-message", "No share for this range: " + explain(error), "error");
  }
}

/** A range's share, with its interval and the bucket edges it was snapped to. */
function showRange(range) {
  say("range-message", "");
  const same = (a, b) => Math.abs(a - b) <= 1e-9 * Math.max(Math.abs(a), Math.abs(b));
  const moved = !same(range.low, range.requested_low) || !same(range.high, range.requested_high);
  document.getElementById("range-fraction").textContent = percent(range.fraction);
  document.getElementById("range-what").textContent =
    " of the values lie from " +
    valuesFromTo(range.low, range.high) +
    " (95% interval " +
    percentInterval(range.ci_low, range.ci_high) +
    ", std " +
    percent(range.std) +
    ").";
  document.getElementById("range-edges").textContent = moved
    ? "Asked for " +
      valuesFromTo(range.requested_low, range.requested_high) +
      ": a range is estimated in whole buckets, so its ends moved to the nearest bucket edges."
    : "Both ends are bucket edges.";
  document.getElementById("range-result").hidden = false;
}

/** The range form: the share of [low, high) over the window shown. */
function askRange(event) {
  event.preventDefault();
  const low = document.getElementById("range-low").valueAsNumber;
  const high = document.getElementById("range-high").valueAsNumber;
  if (!(low < high)) {
    document.getElementById("range-result").hidden = true;
    say("range-message", "The range's low end must be below its high end.", "error");
    return;
  }
  askedRange = [low, high];
  showRangeOf(shownEstimate !== null, generation);
}

/** Show the window's heavy hitters; resolves to the strings found (none on a refusal). */
async function loadHeavyHitters(params, mine) {
  const k = document.getElementById("heavy-k").value;
  const table = document.getElementById("heavy-table").tBodies[0];
  try {
    const body = await api(path + "/heavy-hitters", { ...params, k });
    if (mine !== generation) return [];
    say("heavy-message", body.heavy_hitters.length ? "" : "No string was found in this window.");
    fillRows(
      table,
      body.heavy_hitters.map((item) => [
        el("td", { className: "string" }, item.string),
        percent(item.frequency),
        percentInterval(item.ci_low, item.ci_high),
        percent(item.std),
        count(item.count),
      ]),
    );
    return body.heavy_hitters.map((item) => item.string);
  } catch (error) {
    if (mine === generation) {
      table.replaceChildren();
      say("heavy-message", "No heavy hitters for this window: " + explain(error));
    }
    return [];
  }
}

// --- the series ------------------------------------------------------------------------------

/** The values a series can be drawn for: categories or candidate strings (none for a mean). */
function seriesItems(body) {
  const first = body.steps.find((step) => step.estimate)?.estimate;
  if (!first || body.kind === "numeric" || body.kind === "distribution") return [];
  if (body.kind === "categorical") return first.estimates.map(categoryName);
  if (body.kind === "attributes") return attributeItems(first).map((item) => item.name);
  return first.candidates.map((item) => item.string);
}

/** The item drawn by default: the most frequent in the window's estimate. */
function defaultItem(items) {
  if (metric.attributes) return 0;
  const rows = shownEstimate?.estimates || shownEstimate?.candidates;
  if (!rows || !rows.length) return 0;
  let best = 0;
  rows.forEach((row, i) => {
    if (row.frequency > rows[best].frequency) best = i;
  });
  return Math.min(best, items.length - 1);
}

function pointOf(estimate, kind, index) {
  if (!estimate) return [null, null, null];
  if (kind === "numeric") return [estimate.mean, estimate.ci_low, estimate.ci_high];
  if (kind === "attributes") return attributePoint(estimate, attributeItems(estimate)[index]);
  const row = kind === "categorical" ? estimate.estimates[index] : estimate.candidates[index];
  return [row.frequency, row.ci_low, row.ci_high];
}

function showSeries(body) {
  say("series-message", "");
  shownSeries = body;
  const hourly = body.step === "1h";
  const labels = body.steps.map((step) => utc(step.start, hourly));
  const items = seriesItems(body);
  const index = pickedItem !== null && pickedItem < items.length ? pickedItem : defaultItem(items);
  const total = reportsIn(body);
  const seriesChart = document.getElementById("series-chart");
  document.getElementById("series-item-choice")?.toggleAttribute("hidden", !items.length);
  document.getElementById("series-n-chart-box").hidden = total === 0;
  if (itemChoice) {
    itemChoice.replaceChildren(...items.map((item, i) => el("option", { value: String(i) }, item)));
    itemChoice.value = String(index);
  }
  if (total === 0) {
    placeholder(seriesChart, "No reports in this window yet");
  } else if (!body.steps.some((step) => step.estimate)) {
    placeholder(
      seriesChart,
      "No step has an estimate yet: none holds the " +
        reports(body.min_reports) +
        " of the release threshold in one " +
        oneUnit() +
        " (reports per step below)",
    );
  } else {
    drawSeries(seriesChart, body, items, index);
  }
  const released = body.steps.map((step) => (step.estimate ? step.estimate.n : 0));
  if (total > 0) {
    countChart(document.getElementById("series-n-chart"), {
      labels,
      released,
      suppressed: body.steps.map((step, i) => step.n - released[i]),
    });
  }
  const withEstimate = body.steps.filter((step) => step.estimate).length;
  const below = body.steps.filter((step) => !step.estimate && step.n > 0).length;
  document.getElementById("series-summary").textContent =
    body.steps.length +
    " steps · " +
    withEstimate +
    " with an estimate · " +
    below +
    " with reports but below the release threshold (" +
    reports(body.min_reports) +
    " in one " +
    oneUnit() +
    ") · " +
    reports(total) +
    " in all";
}

/** A distribution's series: each quantile of ``QUANTILES`` per step, with its band. */
function drawQuantileSeries(canvas, body) {
  const quantileOf = (step, q) =>
    step.estimate?.quantiles?.find((item) => Math.abs(item.q - q) < 1e-9) ?? null;
  const first = body.steps.find((step) => step.estimate).estimate;
  bandsChart(canvas, {
    labels: body.steps.map((step) => utc(step.start, body.step === "1h")),
    lines: QUANTILES.map((q, i) => {
      const points = body.steps.map((step) => quantileOf(step, q));
      return {
        label: quantileName(q),
        color: QUANTILE_COLORS[i],
        values: points.map((point) => point?.value ?? null),
        lows: points.map((point) => point?.ci_low ?? null),
        highs: points.map((point) => point?.ci_high ?? null),
      };
    }),
    format: valueText,
    tick: (value) => number(value),
    yTitle: titleWithUnit("quantile", metric.unit) + (first.scale === "log" ? ", log scale" : ""),
    logarithmic: first.scale === "log",
  });
}

/** The series' band chart: a mean (in the metric's unit), one item's share, or a
 * distribution's quantiles. */
function drawSeries(canvas, body, items, index) {
  if (body.kind === "distribution") {
    drawQuantileSeries(canvas, body);
    return;
  }
  const points = body.steps.map((step) => pointOf(step.estimate, body.kind, index));
  const first = body.steps.find((step) => step.estimate)?.estimate;
  const numeric =
    body.kind === "numeric" ||
    (body.kind === "attributes" && attributeItems(first)[index].value === null);
  const item = items[index] ?? "";
  bandChart(canvas, {
    labels: body.steps.map((step) => utc(step.start, body.step === "1h")),
    values: points.map((point) => point[0]),
    lows: points.map((point) => point[1]),
    highs: points.map((point) => point[2]),
    label: numeric ? (body.kind === "attributes" ? item : "mean") : "frequency of " + item,
    format: numeric ? (value) => withUnit(number(value), metric.unit) : percent,
    tick: numeric ? (value) => number(value) : percentTick,
    yTitle: numeric ? titleWithUnit("mean", metric.unit) : "share of reports: " + item,
  });
}

function showNoSeries(error) {
  shownSeries = null;
  say("series-message", "No series for this window. " + explain(error), "error");
  placeholder(document.getElementById("series-chart"), "No series for this window");
  window.Chart.getChart(document.getElementById("series-n-chart"))?.destroy();
  document.getElementById("series-n-chart-box").hidden = true;
  document.getElementById("series-summary").textContent = "";
}

// --- wiring ------------------------------------------------------------------------------------

restore();
form.addEventListener("submit", (event) => {
  event.preventDefault();
  load();
});
preset.addEventListener("change", () => {
  customRange.hidden = preset.value !== "custom";
  if (preset.value !== "custom") load();
});
stepChoice.addEventListener("change", () => load());
itemChoice?.addEventListener("change", () => {
  pickedItem = Number(itemChoice.value);
  if (shownSeries) showSeries(shownSeries);
});
postprocessedToggle?.addEventListener("change", () => shownEstimate && drawBars(shownEstimate));
rangeForm?.addEventListener("submit", askRange);
document.getElementById("heavy-k")?.addEventListener("change", () => load());
onBreakdownChange(() => load());

onKeyChange((hasKey) => {
  document.getElementById("needs-key").hidden = hasKey;
  document.getElementById("analysis").hidden = !hasKey;
  if (hasKey) load();
});
