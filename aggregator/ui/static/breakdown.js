// A metric's breakdown by its public dimensions: the "Break down by" and "Where" choices
// (estimate?by=NAME&where=NAME:VALUE), and the groups of an estimate: for a categorical
// metric each group's frequencies with their intervals (bars grouped by category, and a
// table), for a numeric one each group's mean with its interval, for a distribution each
// group's p50, p95 and p99 with their intervals; the groups the release threshold
// withholds are said in words.
import {
  count,
  el,
  fillRows,
  number,
  percent,
  percentInterval,
  percentTick,
  say,
} from "./common.js";
import { COLORS, groupedBarChart, placeholder } from "./charts.js";

const byChoice = document.getElementById("breakdown-by");
// The most bars a group chart draws; beyond them the table alone shows the groups.
const MOST_BARS = 400;
const whereChoices = [...document.querySelectorAll(".where-select")];

/** Whether the metric has dimensions (the page then shows the choices). */
export const hasDimensions = Boolean(byChoice);

/** The request's breakdown: ``{by, where}`` (by undefined for none; where "NAME:VALUE"s). */
export function chosenBreakdown() {
  if (!hasDimensions) return { by: undefined, where: [] };
  const where = whereChoices
    .filter((select) => select.value && !select.disabled)
    .map((select) => select.dataset.dimension + ":" + select.value);
  return { by: byChoice.value || undefined, where };
}

/** The dimension broken down by cannot be filtered too: its "Where" is set to any. */
function lockBroken() {
  for (const select of whereChoices) {
    const broken = select.dataset.dimension === byChoice.value;
    if (broken) select.value = "";
    select.disabled = broken;
  }
}

/** Put the choices in the page's address (``by``, repeated ``where``). */
export function rememberBreakdown(query) {
  if (!hasDimensions) return;
  const { by, where } = chosenBreakdown();
  if (by) query.set("by", by);
  else query.delete("by");
  query.delete("where");
  for (const item of where) query.append("where", item);
}

/** Take the choices from the page's address (values it does not list are ignored). */
export function restoreBreakdown(query) {
  if (!hasDimensions) return;
  const by = query.get("by");
  if (by && [...byChoice.options].some((option) => option.value === by)) byChoice.value = by;
  for (const item of query.getAll("where")) {
    const at = item.indexOf(":");
    const select = whereChoices.find((s) => s.dataset.dimension === item.slice(0, at));
    if (select && [...select.options].some((option) => option.value === item.slice(at + 1)))
      select.value = item.slice(at + 1);
  }
  lockBroken();
}

/** Call ``reload`` whenever a choice changes. */
export function onBreakdownChange(reload) {
  if (!hasDimensions) return;
  byChoice.addEventListener("change", () => {
    lockBroken();
    reload();
  });
  for (const select of whereChoices) select.addEventListener("change", () => reload());
}

/** A group's name: its values of the by= dimensions, "ios · 2.0". */
export function groupName(body, group) {
  return body.by.map((name) => group.dimensions[name]).join(" · ");
}

function categoryName(item) {
  return item.label ?? "#" + item.index;
}

function setHead(table, names) {
  table.tHead.rows[0].replaceChildren(...names.map((name) => el("th", { scope: "col" }, name)));
}

/** "2 groups hold reports but none of them is released…", or "" when none is withheld. */
function withheldText(body) {
  const withheld = body.withheld_groups;
  if (!withheld) return "";
  const groups = withheld === 1 ? "1 group holds" : withheld + " groups hold";
  return (
    groups +
    " reports in this window but no time bucket of a cell with the " +
    count(body.min_reports) +
    " reports of the release threshold: withheld, not shown."
  );
}

/**
 * The estimate's groups (``body.groups``), or nothing when the estimate has none (no
 * by=). ``quantiles``: the levels of a distribution the page asks for, ``quantileName``
 * and ``quantileColors`` how it names and colours them; ``unitTitle``: a column or axis
 * title with the metric's unit.
 */
export function showGroups(body, { quantiles, quantileName, quantileColors, unitTitle }) {
  const section = document.getElementById("groups-section");
  if (!section) return;
  if (!body || !body.groups) {
    section.hidden = true;
    return;
  }
  section.hidden = false;
  document.getElementById("groups-title").textContent =
    "By " +
    body.by.join(" × ") +
    (body.where && Object.keys(body.where).length ? " (where " + whereText(body.where) + ")" : "");
  say("groups-withheld", withheldText(body));
  const canvas = document.getElementById("groups-chart");
  const table = document.getElementById("groups-table");
  const groups = body.groups;
  if (!groups.length) {
    placeholder(canvas, "No group has a released estimate in this window");
    setHead(table, []);
    table.tBodies[0].replaceChildren();
    return;
  }
  const names = groups.map((group) => groupName(body, group));
  const kind = groups[0].kind;
  if (kind === "categorical" || kind === "string") {
    showShares(canvas, table, groups, names, kind);
  } else if (kind === "numeric") {
    showMeans(canvas, table, groups, names, unitTitle);
  } else if (kind === "distribution") {
    showQuantiles(canvas, table, groups, names, {
      quantiles,
      quantileName,
      quantileColors,
      unitTitle,
    });
  } else {
    showAttributeShares(canvas, table, groups, names);
  }
}

function whereText(where) {
  return Object.entries(where)
    .map(([name, value]) => name + " = " + value)
    .join(", ");
}

/** Categories (or candidate strings): bars grouped by category, one per group. */
function showShares(canvas, table, groups, names, kind) {
  const itemsOf = (group) => (kind === "categorical" ? group.estimates : group.candidates);
  const nameOf = kind === "categorical" ? categoryName : (item) => item.string;
  const labels = itemsOf(groups[0]).map(nameOf);
  if (labels.length * groups.length > MOST_BARS) {
    placeholder(canvas, "Too many bars to draw legibly: every group is in the table below");
  } else {
    drawShares(canvas, groups, names, labels, itemsOf, kind);
  }
  setHead(table, [
    "Group",
    "Reports",
    kind === "categorical" ? "Category" : "String",
    "Frequency",
    "95% interval",
    "Std",
  ]);
  fillRows(
    table.tBodies[0],
    groups.flatMap((group, g) =>
      itemsOf(group).map((item) => [
        names[g],
        count(group.n),
        nameOf(item),
        percent(item.frequency),
        percentInterval(item.ci_low, item.ci_high),
        percent(item.std),
      ]),
    ),
  );
}

/** Bars grouped by category: one per group, each with its whisker. */
function drawShares(canvas, groups, names, labels, itemsOf, kind) {
  groupedBarChart(canvas, {
    labels,
    groups: groups.map((group, g) => ({
      label: names[g],
      values: itemsOf(group).map((item) => item.frequency),
      intervals: itemsOf(group).map((item) => [item.ci_low, item.ci_high]),
    })),
    format: percent,
    tick: percentTick,
    xTitle: kind === "categorical" ? "category" : "string",
    yTitle: "share of the group's reports (95% interval)",
  });
}

/** A mean per group, with its interval. */
function showMeans(canvas, table, groups, names, unitTitle) {
  groupedBarChart(canvas, {
    labels: names,
    groups: [
      {
        label: "mean",
        values: groups.map((group) => group.mean),
        intervals: groups.map((group) => [group.ci_low, group.ci_high]),
        color: COLORS.bar,
      },
    ],
    format: (value) => number(value),
    xTitle: "group",
    yTitle: unitTitle("mean") + " (95% interval)",
  });
  setHead(table, ["Group", "Reports", unitTitle("Mean"), unitTitle("95% interval"), "Std"]);
  fillRows(
    table.tBodies[0],
    groups.map((group, g) => [
      names[g],
      count(group.n),
      number(group.mean, 5),
      number(group.ci_low, 5) + " to " + number(group.ci_high, 5),
      number(group.std),
    ]),
  );
}

/** A distribution's quantiles per group, each with its interval. */
function showQuantiles(
  canvas,
  table,
  groups,
  names,
  { quantiles, quantileName, quantileColors, unitTitle },
) {
  const at = (group, q) => group.quantiles.find((item) => Math.abs(item.q - q) < 1e-9) ?? null;
  const logarithmic = groups[0].scale === "log";
  groupedBarChart(canvas, {
    labels: names,
    groups: quantiles.map((q, i) => ({
      label: quantileName(q),
      values: groups.map((group) => at(group, q)?.value ?? null),
      intervals: groups.map((group) => {
        const item = at(group, q);
        return item && [item.ci_low, item.ci_high];
      }),
      color: quantileColors[i],
    })),
    format: (value) => number(value),
    xTitle: "group",
    yTitle: unitTitle("quantile") + " (95% interval)" + (logarithmic ? ", log scale" : ""),
    floor: logarithmic ? groups[0].lower : undefined,
    ceiling: logarithmic ? groups[0].upper : undefined,
  });
  setHead(table, ["Group", "Reports", ...quantiles.map((q) => unitTitle(quantileName(q)))]);
  fillRows(
    table.tBodies[0],
    groups.map((group, g) => [
      names[g],
      count(group.n),
      ...quantiles.map((q) => {
        const item = at(group, q);
        return item
          ? number(item.value) + " (" + number(item.ci_low) + " to " + number(item.ci_high) + ")"
          : "–";
      }),
    ]),
  );
}

/** A multi-attribute metric: each value's share per group (the table; no chart). */
function showAttributeShares(canvas, table, groups, names) {
  placeholder(canvas, "Each group's attributes are in the table below");
  setHead(table, ["Group", "Reports", "Attribute", "Value", "Estimate", "95% interval"]);
  fillRows(
    table.tBodies[0],
    groups.flatMap((group, g) =>
      group.attributes.flatMap((attribute) =>
        attribute.kind === "numeric"
          ? [
              [
                names[g],
                count(attribute.n),
                attribute.name,
                "mean",
                number(attribute.mean),
                number(attribute.ci_low) + " to " + number(attribute.ci_high),
              ],
            ]
          : attribute.estimates.map((item) => [
              names[g],
              count(attribute.n),
              attribute.name,
              item.label,
              percent(item.frequency),
              percentInterval(item.ci_low, item.ci_high),
            ]),
      ),
    ),
  );
}
