// The dashboard's shared pieces: the analyst key, calls to the JSON API, formatting, and
// building elements. Text from the server (names, labels, strings) is only ever set as
// textContent, never parsed as HTML.

const KEY_ITEM = "ldp-analyst-key";
export const base = document.body.dataset.base || "";

/** The analyst key of this tab (sessionStorage: gone when the tab closes), or null. */
export function analystKey() {
  return sessionStorage.getItem(KEY_ITEM);
}

function setKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
}

/** A refusal of the API, with the problem document's detail. */
export class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

/**
 * GET a JSON document of the API with the analyst key as a Bearer header. Resolves to
 * the parsed body; rejects with ApiError (status and the problem's detail). A key the
 * service does not know is forgotten at once.
 */
export async function api(path, params = {}) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    for (const item of [].concat(value)) {
      if (item !== undefined && item !== null) query.append(name, String(item));
    }
  }
  const search = query.toString();
  const url = base + path + (search ? "?" + search : "");
  const headers = { Accept: "application/json" };
  const key = analystKey();
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(url, { headers, cache: "no-store", credentials: "omit" });
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const detail = (body && (body.detail || body.title)) || response.statusText;
    if (response.status === 401 && key) {
      setKey(null);
      refreshKeyPanel("The key was refused (unknown or revoked); enter another.");
      notifyKeyChange();
    }
    throw new ApiError(response.status, detail);
  }
  return body;
}

// --- the key panel ----------------------------------------------------------------------

const listeners = [];

/** Call ``callback(hasKey)`` now and whenever the key is set or forgotten. */
export function onKeyChange(callback) {
  listeners.push(callback);
  callback(Boolean(analystKey()));
}

function notifyKeyChange() {
  for (const callback of listeners) callback(Boolean(analystKey()));
}

function refreshKeyPanel(message) {
  const hasKey = Boolean(analystKey());
  document.getElementById("key-form").hidden = hasKey;
  document.getElementById("key-status").hidden = !hasKey;
  const line = document.getElementById("key-message");
  line.textContent = message || "";
  line.hidden = !message;
}

function setUpKeyPanel() {
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const key = input.value.trim();
    input.value = "";
    if (!key) {
      refreshKeyPanel("Paste an analyst key first.");
      return;
    }
    setKey(key);
    refreshKeyPanel();
    notifyKeyChange();
  });
  document.getElementById("key-forget").addEventListener("click", () => {
    setKey(null);
    refreshKeyPanel("The key is forgotten in this tab.");
    notifyKeyChange();
  });
  refreshKeyPanel();
}

setUpKeyPanel();

// --- what a page shows ------------------------------------------------------------------

/** An element with attributes and children (strings become text nodes). */
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "className") node.className = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** Show ``text`` in the message line ``id`` (hide it when text is empty). */
export function say(id, text, tone = "info") {
  const line = document.getElementById(id);
  if (!line) return;
  line.textContent = text || "";
  line.dataset.tone = tone;
  line.hidden = !text;
}

/** A refusal in words a person can act on. */
export function explain(error) {
  if (!(error instanceof ApiError)) return "The service could not be reached: " + error.message;
  if (error.status === 401) return "An analyst key is needed: " + error.message;
  if (error.status === 403) return "This key may not read estimates (it is not an analyst key).";
  if (error.status === 429) return "Too many requests with this key; try again in a moment.";
  return error.message;
}

/** Replace the rows of a table body. */
export function fillRows(tbody, rows) {
  tbody.replaceChildren(
    ...rows.map((cells) =>
      el(
        "tr",
        {},
        cells.map((c) => cellOf(c)),
      ),
    ),
  );
}

function cellOf(content) {
  if (content instanceof Node && content.nodeName === "TD") return content;
  return el("td", {}, content);
}

// --- numbers and times ------------------------------------------------------------------

/** A share as a percentage with two decimals: 0.41237 -> "41.24%". */
export function percent(value) {
  return Number.isFinite(value) ? (value * 100).toFixed(2) + "%" : "–";
}

/** A share on a chart's axis, with no more digits than it needs: 0.45 -> "45%". */
export function percentTick(value) {
  return Number((value * 100).toPrecision(3)) + "%";
}

/** An interval of shares: "[38.10%, 44.37%]". */
export function percentInterval(low, high) {
  return "[" + percent(low) + ", " + percent(high) + "]";
}

/** A number with up to ``digits`` significant digits. */
export function number(value, digits = 4) {
  if (value === null || value === undefined) return "–";
  if (!Number.isFinite(value)) return value > 0 ? "∞" : "–";
  return Number(value.toPrecision(digits)).toLocaleString("en-US", { maximumFractionDigits: 6 });
}

/** A whole number with thousands separators. */
export function count(value) {
  return Math.round(value).toLocaleString("en-US");
}

/** "2026-11-22 10:00" (UTC) from an ISO time or milliseconds. */
export function utc(time, withTime = true) {
  const text = new Date(time).toISOString();
  return withTime ? text.slice(0, 10) + " " + text.slice(11, 16) : text.slice(0, 10);
}

/** A value with its unit, when the metric has one: "42.1 minutes". */
export function withUnit(text, unit) {
  return unit ? text + " " + unit : text;
}

/** What an axis or a column shows, with its unit when there is one: "mean (minutes)". */
export function titleWithUnit(text, unit) {
  return unit ? text + " (" + unit + ")" : text;
}
