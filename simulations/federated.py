"""``ldp-sim federated``: private federated learning, accuracy against epsilon and clients.

Datasets (scikit-learn, nothing downloaded):

* ``digits``: the 8x8 handwritten digits bundled with scikit-learn (1,797 images, 10
  classes), pixels scaled to [0, 1], 20% held out for testing (fixed by ``--seed``);
* ``synthetic``: ``make_classification`` with 20 features (10 informative) and 4
  classes, two training examples per client plus 5,000 held out: the scale test, meant
  for 100,000 clients.

Partitions of the training examples over the clients: ``iid`` (shuffled, equal shares)
and ``label-skew`` (sorted by label, then cut into equal consecutive shares, so that a
client holds one or two classes: the "sort and partition" split of McMahan et al. 2017).

Each run is one task (:class:`shared.federated.task.TaskState`, the same object the
aggregator runs) in one privacy mode at one target epsilon (``inf``: clipping without
noise), with per-mode defaults tuned on digits (``MODE_DEFAULTS``): every round each
client takes part with probability q (Poisson sampling), trains locally from the global
model (``local_update``: local SGD, or in the ``silo`` mode DP-SGD over its records, the
epsilon then per record of a silo), privatizes its update (``privatize``), and the round
is aggregated and charged (``TaskState.close_round``). The test accuracy of the global
model is recorded after every round. A ``distributed`` task with secure aggregation
(``secure=True``; ``--secure-aggregation``) privatizes onto the integer lattice
(``privatize_on_lattice``), runs every round through SecAgg+
(:func:`shared.federated.secagg.simulate_round`: keys, encrypted shares, masks and
unmasking, with each sampled device dropping out at one of the three later steps with
probability ``dropout``) and closes it from the unmasked sum
(``TaskState.close_secure_round``). In-process by default; with ``--over-http`` the
same run goes through a real ``ldp-aggregator serve`` (``/v1/federated``) with
``client.FederatedClient`` devices, and the accuracy is the one the server reports for
its evaluation set.

Output: a table on screen; with ``--out DIR``, ``results.csv`` (one row per dataset,
partition, clients, mode and target epsilon: ``epsilon_spent``, ``final_accuracy`` and
the task's parameters), ``rounds.csv`` (accuracy per round), ``results.json`` and
``accuracy.png`` (final accuracy against epsilon, one line per mode and client count,
non-private FedAvg and runs at epsilon ``inf`` as dotted horizontal references).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from shared.federated.models import ModelSpec, evaluate, make_model
from shared.federated.privacy import privatize, privatize_on_lattice
from shared.federated.secagg import Dropouts, NotEnoughSharesError, from_ring, simulate_round
from shared.federated.task import RoundRecord, TaskConfig, TaskState, local_update
from simulations import report
from simulations.text import counted

if TYPE_CHECKING:
    from client.federated import FederatedClient, RoundInfo

__all__ = [
    "MODE_DEFAULTS",
    "Dataset",
    "FederatedRun",
    "load_dataset",
    "load_examples",
    "plot_accuracy",
    "plot_accuracy_against_epsilon",
    "run_task",
    "run_task_over_http",
    "task_config",
]

MODES = ("none", "local", "central", "distributed", "silo")
DATASETS = ("digits", "synthetic")
PARTITIONS = ("iid", "label-skew")


@dataclass(frozen=True)
class ModeDefaults:
    """Tuned per-mode settings (on digits; see the README's table). In the silo mode the
    clip norm bounds each record's gradient, and ``epochs`` and ``batch_size`` are each
    silo's DP-SGD epochs per round and expected batch (see :func:`task_config`)."""

    clip_norm: float
    participation: float  # expected share of clients per round (q), capped by max_per_round
    max_per_round: int
    learning_rate: float
    epochs: int
    batch_size: int
    server_momentum: float
    min_share: float | None = None  # distributed: a round may close with this share of q W


MODE_DEFAULTS: dict[str, ModeDefaults] = {
    "none": ModeDefaults(10.0, 0.2, 1000, 0.5, 5, 8, 0.9),
    "central": ModeDefaults(0.5, 0.2, 1000, 0.5, 5, 8, 0.9),
    "distributed": ModeDefaults(0.5, 0.2, 1000, 0.5, 5, 8, 0.9, min_share=0.8),
    "local": ModeDefaults(0.5, 1.0, 1000, 0.5, 5, 8, 0.9),
    "silo": ModeDefaults(1.0, 1.0, 1000, 0.5, 1, 16, 0.5),
}


@dataclass(frozen=True)
class Dataset:
    """Training examples split over clients, and a held-out test set."""

    name: str
    partition: str
    clients: list[tuple[np.ndarray, np.ndarray]]
    test_x: np.ndarray
    test_y: np.ndarray
    num_features: int
    num_classes: int


def load_examples(
    name: str, rng: np.random.Generator, seed: int, synthetic_train: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(train_x, train_y, test_x, test_y)`` of ``name``: digits with 20% held out (the
    split drawn from ``rng``), or ``synthetic_train`` synthetic examples and 5,000 held
    out (generated from ``seed``)."""
    if name == "digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = x / 16.0
        order = rng.permutation(len(x))
        cut = int(round(0.8 * len(x)))
        train, test = order[:cut], order[cut:]
        return x[train], y[train], x[test], y[test]
    if name == "synthetic":
        from sklearn.datasets import make_classification

        held_out = 5000
        x, y = make_classification(
            n_samples=synthetic_train + held_out, n_features=20, n_informative=10,
            n_redundant=2, n_classes=4, n_clusters_per_class=2, class_sep=1.5,
            random_state=seed,
        )  # fmt: skip
        return x[held_out:], y[held_out:], x[:held_out], y[:held_out]
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def load_dataset(name: str, clients: int, partition: str, seed: int) -> Dataset:
    """``name`` split over ``clients`` clients by ``partition`` (seeded)."""
    rng = np.random.default_rng(seed)
    train_x, train_y, test_x, test_y = load_examples(name, rng, seed, 2 * clients)
    if partition == "iid":
        order = rng.permutation(len(train_x))
    elif partition == "label-skew":
        order = np.lexsort((rng.random(len(train_y)), train_y))  # by label, random within
    else:
        raise ValueError(f"unknown partition {partition!r}; choose from {', '.join(PARTITIONS)}")
    shares = np.array_split(order, clients)
    return Dataset(
        name,
        partition,
        [(train_x[s], train_y[s].astype(np.int64)) for s in shares],
        test_x,
        test_y.astype(np.int64),
        int(train_x.shape[1]),
        int(max(train_y.max(), test_y.max()) + 1),
    )


@dataclass
class FederatedRun:
    """One task's outcome."""

    dataset: str
    partition: str
    clients: int
    mode: str
    target_epsilon: float
    config: TaskConfig
    noise_multiplier: float
    epsilon_spent: float = 0.0
    accuracy: list[float] = field(default_factory=list)
    seconds: float = 0.0
    over_http: bool = False

    def row(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "partition": self.partition,
            "clients": self.clients,
            "mode": self.mode,
            "target_epsilon": self.target_epsilon,
            "epsilon_spent": self.epsilon_spent,
            "final_accuracy": self.accuracy[-1] if self.accuracy else math.nan,
            "best_accuracy": float(np.nanmax(self.accuracy)) if self.accuracy else math.nan,
            "rounds": len(self.accuracy),
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.config.clip_norm,
            "clients_per_round": self.config.clients_per_round,
            "delta": self.config.delta,
            "secure_aggregation": self.config.secure_aggregation is not None,
            "over_http": self.over_http,
            "seconds": self.seconds,
        }


def task_config(
    data: Dataset,
    mode: str,
    epsilon: float,
    rounds: int,
    delta: float,
    model: str,
    seed: int,
    secure: bool = False,
) -> TaskConfig:
    """The task a run trains: the mode's defaults, the target epsilon (inf: no noise);
    ``secure``: a ``distributed`` task with secure aggregation (default settings).

    In the silo mode (epsilon per record) each silo's DP-SGD samples its records at
    ``q_r = B / n`` for ``ceil(E / q_r)`` steps a round (``E`` epochs at expected batch
    ``B``), with ``n`` the median silo's record count.
    """
    defaults = MODE_DEFAULTS[mode]
    population = len(data.clients)
    per_round = min(population, max(1.0, defaults.participation * population))
    per_round = min(per_round, defaults.max_per_round)
    privacy: dict[str, Any] = {}
    if mode != "none":
        privacy = {"noise_multiplier": 0.0} if math.isinf(epsilon) else {"target_epsilon": epsilon}
    return TaskConfig.model_validate(
        {
            "model": ModelSpec.model_validate(
                {"kind": model, "num_features": data.num_features, "num_classes": data.num_classes}
            ),
            "mode": mode,
            "rounds": rounds,
            "population": population,
            "clients_per_round": per_round,
            "clip_norm": defaults.clip_norm,
            "delta": delta,
            **_training(data, defaults, mode),
            "server_momentum": defaults.server_momentum,
            "min_clients": (
                1
                if defaults.min_share is None
                else max(1, math.floor(defaults.min_share * per_round))
            ),
            "max_clients": population,
            "seed": seed,
            **privacy,
            **({"secure_aggregation": {}} if secure and mode == "distributed" else {}),
        }
    )


def _training(data: Dataset, defaults: ModeDefaults, mode: str) -> dict[str, Any]:
    """The task's local training: ``dpsgd`` in the silo mode, else ``local_training``."""
    if mode == "silo":
        records = max(1, int(np.median([len(x) for x, _ in data.clients])))
        rate = min(1.0, defaults.batch_size / records)
        steps = math.ceil(defaults.epochs / rate)
        return {"dpsgd": {"sample_rate": rate, "steps": steps,
                          "learning_rate": defaults.learning_rate}}  # fmt: skip
    return {
        "local_training": {
            "epochs": defaults.epochs,
            "batch_size": defaults.batch_size,
            "learning_rate": defaults.learning_rate,
        }
    }


#: Float rounding allowed above an upload's norm bound, as the aggregator allows it
#: (``aggregator.federated.NORM_ROUNDING``: clipping lands a few ulps above ``C``).
UPLOAD_NORM_ROUNDING = 1e-9

#: What a malicious client does to its local update before privatizing it, given the update
#: and the mode's bound on an upload (:func:`upload_bound`): ``simulations.federated_attack``.
Poison = Callable[[np.ndarray, float], np.ndarray]

#: The modes whose client clips its update to ``C`` (one user moves the sum by at most C).
USER_LEVEL_MODES = ("local", "central", "distributed")


def upload_bound(mode: str, clip_norm: float, update: np.ndarray) -> float:
    """The norm an honest client's privatized update is held to before its noise: ``C`` in
    the user-level modes; in the ``silo`` and ``none`` modes nothing bounds it, and this is
    the update's own norm (an attack that keeps to it keeps the honest size)."""
    return clip_norm if mode in USER_LEVEL_MODES else float(np.linalg.norm(update))


def _poisoned(
    updates: list[np.ndarray],
    holders: list[int],
    malicious: np.ndarray,
    poison: Poison,
    state: TaskState,
) -> tuple[list[np.ndarray], np.ndarray]:
    """The malicious holders' updates replaced by ``poison``'s, each as ``(v / k, k)``: a
    client that skips its own clipping privatizes ``v / k`` at the bound ``C`` and uploads
    ``k`` times the result, ``k = max(1, ||v|| / C)`` (1 for an attack within the bound and
    for every honest client, whose uploads are then unchanged, draw for draw)."""
    scales = np.ones(len(updates))
    out = list(updates)
    for row, (update, index) in enumerate(zip(updates, holders, strict=True)):
        if malicious[index]:
            forged = poison(update, upload_bound(state.config.mode, state.clip_norm, update))
            scales[row] = max(1.0, float(np.linalg.norm(forged)) / state.clip_norm)
            out[row] = forged / scales[row]
    return out, scales


def run_task(
    data: Dataset,
    config: TaskConfig,
    epsilon: float,
    seed: int,
    dropout: float = 0.0,
    malicious: np.ndarray | None = None,
    poison: Poison | None = None,
) -> FederatedRun:
    """Train in this process, round by round, as the aggregator would; with secure
    aggregation, ``dropout`` is the chance that a sampled device drops out of a round
    (after advertising its keys: at the shares, masked-input or unmasking step, each as
    likely). ``malicious`` (a bool per client) marks the clients whose local update
    ``poison`` replaces before it is privatized (it draws nothing, so a run with and
    without the attack sample the same rounds; one beyond ``C`` is uploaded scaled,
    :func:`_poisoned`). Uploads are then treated as the aggregator treats them: one whose
    norm exceeds :meth:`DPConfig.max_upload_norm` is refused (``aggregator.federated.
    _check_vector``: the local and distributed modes; the central server clips instead,
    the silo and none modes accept any), a masked secure upload is not checked."""
    rng = np.random.default_rng(seed)
    state = TaskState.start(config)
    model = make_model(config.model)
    run = FederatedRun(
        data.name, data.partition, len(data.clients), config.mode, epsilon, config,
        state.noise_multiplier,
    )  # fmt: skip
    started = time.perf_counter()
    for _ in range(config.rounds):
        sampled = np.flatnonzero(rng.random(len(data.clients)) < config.sample_rate)
        holders = [int(i) for i in sampled if len(data.clients[i][0])]
        if len(holders) < config.min_clients:
            run.accuracy.append(run.accuracy[-1] if run.accuracy else math.nan)
            continue  # too few: the service restarts the round (a fresh draw), as here
        updates = [
            local_update(
                config,
                model,
                state.server.params,
                *data.clients[index],
                state.noise_multiplier,
                state.clip_norm,
                rng,
            )  # fmt: skip
            for index in holders
        ]
        scales = np.ones(len(updates))
        if malicious is not None and poison is not None:
            updates, scales = _poisoned(updates, holders, malicious, poison, state)
        evaluation = lambda params: evaluate(model, params, data.test_x, data.test_y)  # noqa: E731
        record: RoundRecord | None
        if config.secure_aggregation is None:
            contributions = [privatize(u, state.dp, state.clip_norm, rng) for u in updates]
            uploads = np.stack([c.update for c in contributions]) * scales[:, None]
            bound = state.dp.max_upload_norm(state.clip_norm, state.num_params)
            accepted = np.linalg.norm(uploads, axis=1) <= bound * (1 + UPLOAD_NORM_ROUNDING)
            if accepted.sum() < config.min_clients:
                run.accuracy.append(run.accuracy[-1] if run.accuracy else math.nan)
                continue  # too few accepted uploads: the service restarts the round
            weights = [len(data.clients[index][0]) for index in holders]
            record = state.close_round(
                uploads[accepted],
                np.array([c.unclipped for c in contributions])[accepted],
                np.array(weights, dtype=np.float64)[accepted], rng, evaluation,
            )  # fmt: skip
        else:
            record = _secure_round(state, updates, scales, dropout, rng, evaluation)
        if record is None:
            run.accuracy.append(run.accuracy[-1] if run.accuracy else math.nan)
            continue  # too few masked inputs or answers: the service restarts the round
        run.accuracy.append(record.evaluation["accuracy"])
    run.epsilon_spent = state.epsilon()
    run.seconds = time.perf_counter() - started
    return run


def _secure_round(
    state: TaskState,
    updates: list[np.ndarray],
    scales: np.ndarray,
    dropout: float,
    rng: np.random.Generator,
    evaluation: Callable[[np.ndarray], dict[str, float]],
) -> RoundRecord | None:
    """One round of a secure task in this process: every device's lattice upload masked
        and the sum unmasked by SecAgg+ (devices dropping at ``dropout``), the round closed from
        that sum; None when the service would restart it: fewer than ``min_clients`` masked
    inputs, or too few unmasking answers. A device's update coordinates are multiplied by
    its ``scales`` entry (rounded to the lattice): nobody can check a masked input."""
    rows = np.stack([privatize_on_lattice(u, state.dp, state.clip_norm, rng) for u in updates])
    rows[:, : state.num_params] = np.rint(rows[:, : state.num_params] * scales[:, None])
    n = rows.shape[0]
    dropouts = Dropouts()
    if dropout > 0:  # drawn only then: without dropouts the run is the plain one, draw for draw
        drops = np.flatnonzero(rng.random(n) < dropout)
        steps = rng.integers(0, 3, drops.size)
        dropouts = Dropouts(*(frozenset(int(i) for i in drops[steps == k]) for k in range(3)))
    if n - len(dropouts.shares) - len(dropouts.masked) < max(2, state.config.min_clients):
        return None
    assert state.config.secure_aggregation is not None
    bits = state.dp.secure_modulus_bits(state.clip_norm, state.num_params, n)
    try:
        secure = simulate_round(rows, state.config.secure_aggregation, bits, dropouts)
    except NotEnoughSharesError:
        return None
    total = from_ring(secure.total, bits)
    return state.close_secure_round(total, len(secure.included), evaluation)


def run_task_over_http(
    data: Dataset, config: TaskConfig, epsilon: float, seed: int, url: str, keys: dict[str, str]
) -> FederatedRun:
    """The same task through a real aggregator and ``FederatedClient`` devices."""
    from client.federated import FederatedClient

    name = f"sim-{data.name}-{data.partition}-{len(data.clients)}-{config.mode}-{epsilon:g}"
    name = name.replace(".", "_").replace("inf", "nonoise")
    admin = {"Authorization": f"Bearer {keys['admin']}"}
    analyst = {"Authorization": f"Bearer {keys['analyst']}"}
    body = {
        "name": name,
        "config": config.model_dump(mode="json"),
        "evaluation": {"x": data.test_x.tolist(), "y": data.test_y.tolist()},
    }
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=120.0) as http:
        created = http.post("/v1/federated/tasks", json=body, headers=admin)
        if created.status_code != 201:
            raise RuntimeError(f"creating task {name}: {created.status_code} {created.text}")
        run = FederatedRun(
            data.name, data.partition, len(data.clients), config.mode, epsilon, config,
            float(created.json()["noise_multiplier"]), over_http=True,
        )  # fmt: skip
        seeds = np.random.SeedSequence(seed).spawn(len(data.clients))
        devices = [
            FederatedClient(
                url, keys["device"], name, shard, rng=np.random.default_rng(s), http=http
            )
            for shard, s in zip(data.clients, seeds, strict=True)
            if len(shard[0])
        ]
        for round_number in range(config.rounds):
            info = devices[0].fetch_round()
            if config.secure_aggregation is not None:
                # The four steps interleave across devices: they run side by side, and the
                # relay closes the round itself once the last unmask answer is in.
                with ThreadPoolExecutor(max_workers=len(devices)) as pool:
                    rounds = pool.map(FederatedClient.run_round, devices, [info] * len(devices))
                    uploaded = sum(result.uploaded for result in rounds)
            else:
                uploaded = sum(device.run_round(info).uploaded for device in devices)
            status = http.get(f"/v1/federated/tasks/{name}", headers=analyst).json()
            if status["round"] > info.round or config.secure_aggregation is not None:
                pass  # the round filled up, or its secure steps ended: the service closed it
            elif uploaded >= config.min_clients:
                closed = http.post(f"/v1/federated/tasks/{name}/close", headers=admin)
                if closed.status_code != 200:
                    raise RuntimeError(f"closing round {round_number}: {closed.text}")
                status = closed.json()
            else:  # too few: the service restarts the round at its deadline
                wait_for_restart(devices[0], info)
                status = http.get(f"/v1/federated/tasks/{name}", headers=analyst).json()
            evaluation = status.get("evaluation") or {}
            run.accuracy.append(float(evaluation.get("accuracy", math.nan)))
            if status["state"] != "running":
                break
        epsilon_spent = status["epsilon_spent"]
        run.epsilon_spent = math.inf if epsilon_spent is None else float(epsilon_spent)
    run.seconds = time.perf_counter() - started
    return run


def wait_for_restart(device: FederatedClient, info: RoundInfo) -> None:
    """Wait until the aggregator restarted ``info``'s round (its deadline passed with too
    few uploads), so that devices decide again on a new attempt rather than upload twice
    to the same one."""
    while True:
        time.sleep(max(0.0, info.deadline - time.time()) + 0.05)
        current = device.fetch_round()
        if (current.round, current.attempt) != (info.round, info.attempt):
            return


# --- plots ----------------------------------------------------------------------------------


def plot_accuracy(rows: list[dict[str, Any]], path: Path) -> None:
    """Final accuracy against epsilon, per mode and clients; plain FedAvg as a reference."""
    series: dict[str, list[tuple[float, float]]] = {}
    references: dict[str, float] = {}
    for row in rows:
        label = (
            f"{row['mode']}, {counted(row['clients'], 'client')} "
            f"({row['dataset']}, {row['partition']})"
        )
        if row["mode"] == "none":
            references[label] = row["final_accuracy"]
        else:
            series.setdefault(label, []).append((row["target_epsilon"], row["final_accuracy"]))
    plot_accuracy_against_epsilon(series, references, path)


def plot_accuracy_against_epsilon(
    series: dict[str, list[tuple[float, float]]], references: dict[str, float], path: Path
) -> None:
    """Accuracy against epsilon (log axis): one line per ``series`` over its finite
    ``(epsilon, accuracy)`` points; a series' point at epsilon ``inf`` (clipping without
    noise) is a dotted horizontal line in the series' colour, labelled "epsilon inf", and
    each of ``references`` (non-private runs) a dotted horizontal line of its own colour.
    No slot of the epsilon axis stands for inf: a baseline is a level, not an epsilon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted({eps for points in series.values() for eps, _ in points if math.isfinite(eps)})
    figure, axes = plt.subplots(figsize=(7, 4.6))
    for index, label in enumerate(sorted(series) + sorted(references)):
        style = report.series_style(index)
        if label in references:
            axes.axhline(references[label], linestyle=":", color=style["color"], label=label)
            continue
        points = sorted(series[label])
        drawn = [(eps, acc) for eps, acc in points if math.isfinite(eps)]
        if drawn:
            axes.plot(*zip(*drawn, strict=True), label=label, **style)
        for eps, acc in points:
            if math.isinf(eps):
                axes.axhline(
                    acc, linestyle=":", linewidth=1.4, color=style["color"],
                    label=f"{label}: epsilon inf (no noise)",
                )  # fmt: skip
    if finite:
        axes.set_xscale("log")
        axes.set_xticks(finite, [f"{t:g}" for t in finite])
        axes.minorticks_off()
    axes.set_xlabel("target epsilon (delta fixed; dotted: without noise)")
    axes.set_ylabel("final test accuracy")
    axes.set_ylim(0, 1)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="x-small", loc="lower right")
    report.save_figure(figure, path)
