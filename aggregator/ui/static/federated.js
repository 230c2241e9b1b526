// The federated training tasks (GET /v1/federated/tasks, analyst key).
import { api, base, el, explain, fillRows, number, onKeyChange, say } from "./common.js";

function evaluation(status) {
  const entries = Object.entries(status.evaluation || {});
  return entries.length
    ? entries.map(([name, value]) => name + " " + number(value)).join(", ")
    : "–";
}

async function load() {
  const table = document.getElementById("task-table").tBodies[0];
  try {
    const tasks = await api("/v1/federated/tasks");
    say(
      "tasks-message",
      tasks.length
        ? ""
        : "No training task yet: an admin creates one with POST /v1/federated/tasks.",
    );
    fillRows(
      table,
      tasks.map((task) => [
        el(
          "td",
          {},
          el("a", { href: base + "/ui/federated/" + encodeURIComponent(task.name) }, task.name),
        ),
        task.mode,
        task.state,
        task.round + " of " + task.rounds,
        task.epsilon_spent === null ? "unbounded" : number(task.epsilon_spent),
        task.budget === null ? "none" : number(task.budget),
        evaluation(task),
      ]),
    );
  } catch (error) {
    table.replaceChildren();
    say("tasks-message", explain(error), "error");
  }
}

onKeyChange((hasKey) => {
  document.getElementById("needs-key").hidden = hasKey;
  document.getElementById("tasks").hidden = !hasKey;
  if (hasKey) load();
});
