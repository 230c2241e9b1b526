// One federated task (GET /v1/federated/tasks/{name}, analyst key): its status, the
// model's evaluation and the epsilon spent after each round.
import { api, el, explain, fillRows, number, onKeyChange, percentTick, say } from "./common.js";
import { linesChart } from "./charts.js";

const name = document.getElementById("task").dataset.name;

function fact(term, value) {
  return [el("dt", {}, term), el("dd", {}, value)];
}

function showStatus(task) {
  const spent = task.epsilon_spent === null ? "unbounded (no noise)" : number(task.epsilon_spent);
  document
    .getElementById("task-summary")
    .replaceChildren(
      ...fact("State", task.state),
      ...fact("Mode", task.mode),
      ...fact(
        "Round",
        task.round +
          " of " +
          task.rounds +
          (task.attempt ? " (attempt " + (task.attempt + 1) + ")" : ""),
      ),
      ...fact("ε spent", spent + " at δ = " + number(task.delta)),
      ...fact("ε budget", task.budget === null ? "none" : number(task.budget)),
      ...fact("Noise multiplier", number(task.noise_multiplier)),
      ...fact("Clip norm", number(task.clip_norm)),
      ...fact("Updates in the open round", String(task.updates_received)),
    );
}

function showRounds(task) {
  const rounds = task.history.map((record) => String(record.round));
  const metrics = [...new Set(task.history.flatMap((record) => Object.keys(record.evaluation)))];
  // Accuracy on the left (0 to 100%), any other measure (the loss) on the right.
  linesChart(document.getElementById("task-evaluation-chart"), {
    labels: rounds,
    series: metrics.map((metric) => ({
      label: metric,
      values: task.history.map((record) => record.evaluation[metric] ?? null),
      axis: metric === "accuracy" ? "y" : "other",
    })),
    format: (value) => number(value),
    axes: {
      y: { min: 0, max: 1, format: percentTick, title: { display: true, text: "accuracy" } },
      other: {
        position: "right",
        grid: { drawOnChartArea: false },
        display: "auto",
        title: {
          display: true,
          text: metrics.filter((metric) => metric !== "accuracy").join(", "),
        },
      },
    },
  });
  const spent = { label: "ε spent", values: task.history.map((record) => record.epsilon) };
  const series = [spent];
  if (task.budget !== null) {
    series.push({
      label: "ε budget",
      values: rounds.map(() => task.budget),
      dashed: true,
      color: "#9ca3af",
    });
  }
  linesChart(document.getElementById("task-epsilon-chart"), {
    labels: rounds,
    series,
    format: (value) => number(value),
    axes: { y: { beginAtZero: true } },
  });
  fillRows(
    document.getElementById("round-table").tBodies[0],
    [...task.history].reverse().map((record) => [
      String(record.round),
      String(record.participants),
      number(record.clip_norm),
      record.epsilon === null ? "unbounded" : number(record.epsilon),
      Object.entries(record.evaluation)
        .map(([key, value]) => key + " " + number(value))
        .join(", ") || "–",
    ]),
  );
  if (!task.history.length) say("task-message", "No round has closed yet.");
}

async function load() {
  try {
    const task = await api("/v1/federated/tasks/" + encodeURIComponent(name));
    say("task-message", "");
    showStatus(task);
    showRounds(task);
  } catch (error) {
    say("task-message", explain(error), "error");
  }
}

onKeyChange((hasKey) => {
  document.getElementById("needs-key").hidden = hasKey;
  document.getElementById("task-detail").hidden = !hasKey;
  if (hasKey) load();
});
