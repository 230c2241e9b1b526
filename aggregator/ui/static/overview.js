// The metric list: filter the rows as the user types (the list itself is rendered by the
// server and public).
import "./common.js";

const filter = document.getElementById("metric-filter");
const rows = [...document.querySelectorAll("#metric-table tbody tr")];
const shown = document.getElementById("metric-count");
const none = document.getElementById("metric-none");

function apply() {
  const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
  let visible = 0;
  for (const row of rows) {
    const match = words.every((word) => row.dataset.search.includes(word));
    row.hidden = !match;
    visible += match;
  }
  shown.textContent = visible + " of " + rows.length + " metric" + (rows.length === 1 ? "" : "s");
  if (none) none.hidden = visible > 0;
}

filter.addEventListener("input", apply);
