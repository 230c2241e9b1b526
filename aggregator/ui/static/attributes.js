// A multi-attribute metric's estimate (kind "attributes"): a chart per attribute (each
// value's unbiased share as a bar with its 95% interval whisker, or a numeric attribute's
// mean with its interval), and per declared pair its joint distribution as a heat map
// (colour: the post-processed share; text and tooltip: the unbiased share and its
// interval), the same cells as a table beside it, and the conditional shares in the
// direction chosen, with their intervals.
import { count, el, fillRows, number, percent, percentInterval, percentTick } from "./common.js";
import { barChart } from "./charts.js";

/** The heat map's darkest colour (the highest post-processed share). */
const HEAT = [29, 78, 216];

/** A heat map cell's colour: white for 0, ``HEAT`` for the highest share ``top``. */
function heat(share, top) {
  const level = top > 0 ? Math.min(1, Math.max(0, share / top)) : 0;
  const [r, g, b] = HEAT.map((c) => Math.round(255 + (c - 255) * level));
  return { color: "rgb(" + r + ", " + g + ", " + b + ")", dark: level > 0.55 };
}

/** The estimate's attributes and marginals drawn into the page. */
export function showAttributes(body) {
  const charts = document.getElementById("attribute-charts");
  charts.replaceChildren(...body.attributes.map((attribute, i) => attributeCard(attribute, i)));
  body.attributes.forEach((attribute, i) => drawAttribute(attribute, i));
  document
    .getElementById("marginals")
    .replaceChildren(...body.marginals.map((marginal, k) => marginalSection(marginal, k)));
  document
    .getElementById("estimate-facts")
    .append(
      el("span", { className: "fact" }, "protocol " + body.protocol),
      el("span", { className: "fact" }, "frequency oracle " + body.oracle),
    );
}

/** Empty the attributes' charts and the marginals (no estimate in the window). */
export function clearAttributes() {
  for (const canvas of document.querySelectorAll("#attribute-charts canvas")) {
    window.Chart.getChart(canvas)?.destroy();
  }
  document.getElementById("attribute-charts")?.replaceChildren();
  document.getElementById("marginals")?.replaceChildren();
}

function attributeCard(attribute, i) {
  const numeric = attribute.kind === "numeric";
  const facts =
    "n = " +
    count(attribute.n) +
    (numeric
      ? " · values in [" + number(attribute.lower) + ", " + number(attribute.upper) + "]"
      : " · " +
        (attribute.method === "consistent" ? "consistent with the declared pairs" : "direct"));
  const table = numeric ? meanTable(attribute) : sharesTable(attribute);
  return el(
    "section",
    { className: "attribute", id: "attribute-" + i, "data-attribute": attribute.name },
    el("h3", {}, attribute.name),
    el("p", { className: "muted small" }, facts),
    el(
      "div",
      { className: "chart-box" + (numeric ? " short" : "") },
      el("canvas", {
        id: "attribute-chart-" + i,
        role: "img",
        "aria-label": numeric
          ? "Mean of " + attribute.name + " with its 95% interval"
          : "Estimated share of each value of " + attribute.name + " with its 95% interval",
      }),
    ),
    table,
  );
}

function sharesTable(attribute) {
  const table = el(
    "table",
    { className: "numbers attribute-table" },
    el(
      "thead",
      {},
      el(
        "tr",
        {},
        ["Value", "Frequency", "95% interval", "Std", "Post-processed"].map((name) =>
          el("th", { scope: "col" }, name),
        ),
      ),
    ),
    el("tbody"),
  );
  fillRows(
    table.tBodies[0],
    attribute.estimates.map((item, v) => [
      item.label,
      percent(item.frequency),
      percentInterval(item.ci_low, item.ci_high),
      percent(item.std),
      percent(attribute.postprocessed[v].frequency),
    ]),
  );
  return table;
}

function meanTable(attribute) {
  const table = el(
    "table",
    { className: "numbers attribute-table" },
    el(
      "thead",
      {},
      el(
        "tr",
        {},
        ["Mean", "95% interval", "Std", "Clipped to the bounds"].map((name) =>
          el("th", { scope: "col" }, name),
        ),
      ),
    ),
    el("tbody"),
  );
  fillRows(table.tBodies[0], [
    [
      number(attribute.mean, 5),
      number(attribute.ci_low, 5) + " to " + number(attribute.ci_high, 5),
      number(attribute.std),
      number(attribute.postprocessed_mean, 5),
    ],
  ]);
  return table;
}

function drawAttribute(attribute, i) {
  const canvas = document.getElementById("attribute-chart-" + i);
  if (attribute.kind === "numeric") {
    barChart(canvas, {
      labels: ["mean"],
      values: [attribute.mean],
      intervals: [[attribute.ci_low, attribute.ci_high]],
      label: "mean",
      format: (value) => number(value),
      xTitle: attribute.name,
      yTitle: "mean (95% interval)",
    });
    return;
  }
  barChart(canvas, {
    labels: attribute.estimates.map((item) => item.label),
    values: attribute.estimates.map((item) => item.frequency),
    intervals: attribute.estimates.map((item) => [item.ci_low, item.ci_high]),
    label: "frequency",
    format: percent,
    tick: percentTick,
    xTitle: attribute.name,
    yTitle: "share of devices (95% interval)",
  });
}

// --- a declared pair ----------------------------------------------------------------------

function marginalSection(marginal, k) {
  const [first, second] = marginal.attributes;
  const choice = el(
    "select",
    { id: "conditional-" + k, className: "conditional-choice" },
    el("option", { value: "given_first" }, "share of each " + second + " among a " + first),
    el("option", { value: "given_second" }, "share of each " + first + " among a " + second),
  );
  const conditional = el("div", { className: "conditional", id: "conditional-table-" + k });
  choice.addEventListener("change", () => fillConditional(conditional, marginal, choice.value));
  fillConditional(conditional, marginal, choice.value);
  return el(
    "section",
    { className: "marginal", id: "marginal-" + k, "data-pair": first + "," + second },
    el("h3", {}, first + " × " + second + " (joint)"),
    el(
      "p",
      { className: "muted small" },
      "n = " +
        count(marginal.n) +
        ". Colour: the post-processed share (a valid joint distribution; biased). In each cell: " +
        "the unbiased share and its 95% interval. Rows: " +
        first +
        "; columns: " +
        second +
        ".",
    ),
    el(
      "div",
      { className: "marginal-layout" },
      el("div", { className: "heatmap-box" }, heatMap(marginal, k)),
      el("div", { className: "cells-box" }, cellsTable(marginal, k)),
    ),
    el(
      "div",
      { className: "toolbar" },
      el("label", { for: "conditional-" + k }, "Conditional shares:"),
      choice,
      el("span", { className: "muted small" }, "(delta-method intervals)"),
    ),
    conditional,
  );
}

/** The joint distribution as a table whose cells are coloured by their post-processed share. */
function heatMap(marginal, k) {
  const [first, second] = marginal.attributes;
  const columns = marginal.columns.length;
  const top = Math.max(...marginal.cells.map((cell) => cell.postprocessed));
  const head = el(
    "tr",
    {},
    el("th", { scope: "col", className: "corner" }, first + " \\ " + second),
    marginal.columns.map((column) => el("th", { scope: "col" }, column)),
  );
  const rows = marginal.rows.map((row, i) =>
    el(
      "tr",
      {},
      el("th", { scope: "row" }, row),
      marginal.cells
        .slice(i * columns, (i + 1) * columns)
        .map((cell) => heatCell(cell, top, first, second)),
    ),
  );
  return el(
    "table",
    {
      className: "heatmap",
      id: "heatmap-" + k,
      "aria-label": "Joint distribution of " + first + " and " + second,
    },
    el("thead", {}, head),
    el("tbody", {}, rows),
  );
}

function heatCell(cell, top, first, second) {
  const { color, dark } = heat(cell.postprocessed, top);
  const td = el(
    "td",
    {
      className: "heat" + (dark ? " dark" : ""),
      title:
        first +
        " = " +
        cell.row +
        ", " +
        second +
        " = " +
        cell.column +
        ": unbiased " +
        percent(cell.frequency) +
        " (95% interval " +
        percentInterval(cell.ci_low, cell.ci_high) +
        ", std " +
        percent(cell.std) +
        "); post-processed " +
        percent(cell.postprocessed),
    },
    el("span", { className: "heat-share" }, percent(cell.frequency)),
    el("span", { className: "heat-interval" }, percentInterval(cell.ci_low, cell.ci_high)),
  );
  td.style.backgroundColor = color; // CSSOM, which the pages' policy allows (no style attribute)
  return td;
}

function cellsTable(marginal, k) {
  const [first, second] = marginal.attributes;
  const table = el(
    "table",
    { className: "numbers cells-table", id: "cells-table-" + k },
    el(
      "thead",
      {},
      el(
        "tr",
        {},
        [first, second, "Frequency", "95% interval", "Std", "Post-processed"].map((name) =>
          el("th", { scope: "col" }, name),
        ),
      ),
    ),
    el("tbody"),
  );
  fillRows(
    table.tBodies[0],
    marginal.cells.map((cell) => [
      cell.row,
      cell.column,
      percent(cell.frequency),
      percentInterval(cell.ci_low, cell.ci_high),
      percent(cell.std),
      percent(cell.postprocessed),
    ]),
  );
  return table;
}

/**
 * The conditional shares of ``direction`` ("given_first": rows are the first attribute's
 * values, each row a distribution over the second's; "given_second": columns the
 * second's, each column a distribution over the first's), as a grid.
 */
function fillConditional(box, marginal, direction) {
  const [first, second] = marginal.attributes;
  const columns = marginal.columns.length;
  const items = marginal[direction];
  const caption =
    direction === "given_first"
      ? "P(" + second + " = column | " + first + " = row)"
      : "P(" + first + " = row | " + second + " = column)";
  const cell = (item) =>
    item.share === null
      ? el(
          "td",
          { className: "no-answer", title: "the condition's estimated share is not positive" },
          "–",
        )
      : el(
          "td",
          {},
          el("span", { className: "heat-share" }, percent(item.share)),
          el("span", { className: "heat-interval" }, percentInterval(item.ci_low, item.ci_high)),
        );
  box.replaceChildren(
    el(
      "table",
      { className: "numbers conditional-table", "data-direction": direction },
      el("caption", {}, caption),
      el(
        "thead",
        {},
        el(
          "tr",
          {},
          el("th", { scope: "col", className: "corner" }, first + " \\ " + second),
          marginal.columns.map((column) => el("th", { scope: "col" }, column)),
        ),
      ),
      el(
        "tbody",
        {},
        marginal.rows.map((row, i) =>
          el(
            "tr",
            {},
            el("th", { scope: "row" }, row),
            items.slice(i * columns, (i + 1) * columns).map(cell),
          ),
        ),
      ),
    ),
  );
}

// --- over time ----------------------------------------------------------------------------

/** What a series of an attributes metric can draw: every categorical value and every mean. */
export function attributeItems(estimate) {
  return estimate.attributes.flatMap((attribute, a) =>
    attribute.kind === "numeric"
      ? [{ name: attribute.name + " (mean)", attribute: a, value: null }]
      : attribute.estimates.map((item, v) => ({
          name: attribute.name + " = " + item.label,
          attribute: a,
          value: v,
        })),
  );
}

/** One item's [estimate, low, high] in a step's estimate. */
export function attributePoint(estimate, item) {
  const attribute = estimate.attributes[item.attribute];
  if (item.value === null) return [attribute.mean, attribute.ci_low, attribute.ci_high];
  const row = attribute.estimates[item.value];
  return [row.frequency, row.ci_low, row.ci_high];
}
