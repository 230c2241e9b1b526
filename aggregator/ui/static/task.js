// One federated task (GET /v1/federated/tasks/{name}, analyst key): its status, the
// model's evaluation and the epsilon spent after each round.
import { api, el, explain, fillRows, number, onKeyChange, percentTick, say } from "./common.js";
import { linesChart, placeholder } from "./charts.js";

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

/** The budget line's headroom: the axis reaches this far above it, off the frame. */
const BUDGET_HEADROOM = 1.1;

function showRounds(task) {
  const rounds = task.history.map((record) => String(record.round));
  const evaluationChart = document.getElementById("task-evaluation-chart");
  const epsilonChart = document.getElementById("task-epsilon-chart");
  if (!task.history.length) {
    placeholder(evaluationChart, "No round has closed yet");
    placeholder(epsilonChart, "No round has closed yet: no privacy spent");
  } else {
    drawEvaluation(evaluationChart, task, rounds);
    drawEpsilon(epsilonChart, task, rounds);
  }
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

/**
 * The model's evaluation per round: accuracy on the left (0 to 100%), any other measure
 * (the loss) on the right.
 */
function drawEvaluation(canvas, task, rounds) {
  const metrics = [...new Set(task.history.flatMap((record) => Object.keys(record.evaluation)))];
  if (!metrics.length) {
    placeholder(canvas, "No evaluation: the task has no evaluation set");
    return;
  }
  const others = metrics.filter((metric) => metric !== "accuracy");
  linesChart(canvas, {
    labels: rounds,
    series: metrics.map((metric) => ({
      label: metric,
      values: task.history.map((record) => record.evaluation[metric] ?? null),
      axis: metric === "accuracy" ? "y" : "other",
    })),
    format: (value) => number(value),
    xTitle: "round",
    axes: {
      y: { min: 0, max: 1, format: percentTick, title: "accuracy", display: "auto" },
      other: {
        position: "right",
        grid: { drawOnChartArea: false },
        display: "auto",
        title: others.join(", "),
      },
    },
  });
}

/**
 * Epsilon spent after each round, with the budget as a dashed line that the axis always
 * reaches past (even when the spending is far below it, or its line is hidden).
 */
function drawEpsilon(canvas, task, rounds) {
  const series = [{ label: "ε spent", values: task.history.map((record) => record.epsilon) }];
  if (task.budget !== null) {
    series.push({
      label: "ε budget",
      values: rounds.map(() => task.budget),
      level: true,
      color: "#6b7280",
    });
  }
  linesChart(canvas, {
    labels: rounds,
    series,
    format: (value) => number(value),
    xTitle: "round",
    axes: {
      y: {
        beginAtZero: true,
        suggestedMax: task.budget === null ? undefined : task.budget * BUDGET_HEADROOM,
        title: "ε spent (δ = " + number(task.delta) + ")",
      },
    },
  });
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
