"""Benchmark of DP-SGD against Opacus: accuracy, seconds per epoch, and the accountants.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.dpsgd_bench --quick   # digits, one seed, about a minute
    python -m simulations.benchmarks.dpsgd_bench           # digits and synthetic, 10-20 minutes

Both sides train the same model on the same records (``simulations.dpsgd.load_records``:
digits, and the synthetic task of 10^5 records) from the same initial parameters (ours,
copied into the torch module), at the same expected batch size, epochs, clip norm,
learning rate (plain SGD, no momentum), epsilon and delta, with Poisson sampling at
``q = 1 / ceil(N / B)`` for ``ceil(N / B)`` steps per epoch:

* ours: :mod:`shared.federated.dpsgd` (numpy, float64), sigma calibrated by our PLD
  accountant (``DPSGD.calibrated``), batches and noise from a seeded generator;
* Opacus 1.x: ``PrivacyEngine().make_private_with_epsilon(..., poisson_sampling=True)``
  (torch, float32), sigma calibrated by its default accountant (PRV), no secure mode,
  on ``--torch-threads`` threads (1 by default: on 2 shared cores, two threads made its
  epochs 2-4x slower and erratic for these small models).

Columns: the test accuracy of each (mean over ``--repeats`` seeds, run alternately) and
their difference in points with its standard error; seconds per epoch of the training
steps alone (best over the seeds; no calibration, no evaluation) and our speed-up; ours
again with ``rng=None`` (batches and noise from the operating system's CSPRNG, what a
device uses) for one epoch; each side's sigma; and, for Opacus's own run (its sigma, q
and steps), the epsilon its accountant reports beside the epsilon ours computes for it
(PLD and RDP).

Targets (MISS lines, not failures): accuracy within 2 points of Opacus's at every
setting; at least 3x its speed per epoch for the logistic model.

torch and opacus are the optional ``bench`` extra; without them the peer columns are
skipped with a message.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.accounting import gaussian_epsilon
from shared.federated.dpsgd import dpsgd_train
from shared.federated.models import ModelSpec, make_model
from simulations import report
from simulations.dpsgd import DPSGDRun, Records, Settings, load_records, run_dpsgd, settings_for

#: Seeds per setting unless ``--repeats`` says otherwise: test accuracy on digits' 359
#: held-out images varies by 2-3 points from seed to seed at epsilon 1.
REPEATS = {"digits": 10, "synthetic": 3}

#: The accuracy gap (points) and the logistic speed-up the targets ask for.
ACCURACY_TARGET_POINTS = 2.0
SPEEDUP_TARGET = 3.0


@dataclass(frozen=True)
class PeerRun:
    """One Opacus run: accuracy, training seconds per epoch, sigma, its epsilon, steps."""

    accuracy: float
    seconds_per_epoch: float
    noise_multiplier: float
    epsilon: float
    sample_rate: float
    steps: int


def opacus_available() -> str | None:
    """None when torch and opacus import, else why not."""
    try:
        import opacus  # noqa: F401
        import torch  # noqa: F401
    except ImportError as error:
        return f"{error}; install the bench extra: pip install -e '.[bench]'"
    return None


def torch_module(model_kind: str, records: Records, params: np.ndarray) -> Any:
    """The torch twin of our model, holding ``params`` (our flat layout, weights
    transposed: torch's ``Linear`` stores ``W^T``)."""
    import torch

    spec = ModelSpec(kind=model_kind, num_features=records.num_features,  # type: ignore[arg-type]
                     num_classes=records.num_classes)  # fmt: skip
    model = make_model(spec)
    layers = model._split(params)  # W1, b1[, W2, b2]
    f, k = records.num_features, records.num_classes
    module: Any
    if model_kind == "logistic":
        module = torch.nn.Linear(f, k)
        linears = [module]
    else:
        hidden = layers[1].size
        module = torch.nn.Sequential(
            torch.nn.Linear(f, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, k)
        )
        linears = [module[0], module[2]]
    with torch.no_grad():
        for linear, (w, b) in zip(
            linears, zip(layers[::2], layers[1::2], strict=True), strict=True
        ):
            linear.weight.copy_(torch.tensor(w.T, dtype=torch.float32))
            linear.bias.copy_(torch.tensor(b, dtype=torch.float32))
    return module


def opacus_run(
    records: Records, model_kind: str, epsilon: float, settings: Settings, delta: float,
    seed: int, noise_multiplier: float | None = None,
) -> PeerRun:  # fmt: skip
    """Train with Opacus as described in the module docstring; evaluate once at the end.

    ``make_private_with_epsilon`` calibrates sigma by Opacus's accountant and calls
    ``make_private`` with it; given the ``noise_multiplier`` an earlier seed's call found,
    ``make_private`` is called with it directly (the same run, without calibrating again).
    """
    import torch
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    params = make_model(
        ModelSpec(kind=model_kind, num_features=records.num_features,  # type: ignore[arg-type]
                  num_classes=records.num_classes)
    ).init_params(np.random.default_rng(seed))  # fmt: skip
    module = torch_module(model_kind, records, params)
    data = torch.utils.data.TensorDataset(
        torch.tensor(records.train_x, dtype=torch.float32), torch.tensor(records.train_y)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=settings.batch_size)
    optimizer = torch.optim.SGD(module.parameters(), lr=settings.learning_rate)
    loss = torch.nn.CrossEntropyLoss()
    with warnings.catch_warnings():  # its notes on secure mode, RDP orders, backward hooks
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        common = {"module": module, "optimizer": optimizer, "data_loader": loader,
                  "max_grad_norm": settings.clip_norm, "poisson_sampling": True}  # fmt: skip
        if noise_multiplier is None:
            module, optimizer, loader = engine.make_private_with_epsilon(
                target_epsilon=epsilon, target_delta=delta, epochs=settings.epochs, **common
            )
        else:
            module, optimizer, loader = engine.make_private(
                noise_multiplier=noise_multiplier, **common
            )
        started = time.perf_counter()
        for _ in range(settings.epochs):
            for x, y in loader:
                optimizer.zero_grad()
                loss(module(x), y).backward()
                optimizer.step()
        seconds = time.perf_counter() - started
        spent = float(engine.get_epsilon(delta))
    with torch.no_grad():
        predicted = module(torch.tensor(records.test_x, dtype=torch.float32)).argmax(dim=1)
    return PeerRun(
        float(np.mean(predicted.numpy() == records.test_y)),
        seconds / settings.epochs,
        float(optimizer.noise_multiplier),
        spent,
        1.0 / len(loader),
        settings.epochs * len(loader),
    )


def secure_seconds_per_epoch(records: Records, run: DPSGDRun) -> float:
    """One epoch of ours with ``rng=None``: batches and noise from the OS CSPRNG."""
    spec = ModelSpec(kind=run.model, num_features=records.num_features,  # type: ignore[arg-type]
                     num_classes=records.num_classes)  # fmt: skip
    model = make_model(spec)
    steps = run.settings.steps_per_epoch(len(records.train_x))
    params = model.init_params(np.random.default_rng(0))
    started = time.perf_counter()
    dpsgd_train(model, params, records.train_x, records.train_y, run.config, steps, None)
    return time.perf_counter() - started


def compare(
    records: Records, model_kind: str, epsilon: float, args: argparse.Namespace
) -> dict[str, Any]:
    """One row of the table: ours and Opacus's over ``repeats`` seeds, run alternately so
    that a change in the machine's load falls on both sides alike."""
    settings = settings_for(records.name, epochs=args.epochs)
    repeats = args.repeats or REPEATS[records.name]
    ours: list[DPSGDRun] = []
    peer: list[PeerRun] = []
    for seed in range(repeats):
        ours.append(run_dpsgd(records, model_kind, epsilon, settings, args.delta, "pld", seed))
        if args.peer_problem is None:
            sigma = peer[0].noise_multiplier if peer else None
            peer.append(opacus_run(records, model_kind, epsilon, settings, args.delta, seed, sigma))
    accuracy = np.array([r.accuracy[-1] for r in ours])
    row: dict[str, Any] = {
        "dataset": records.name,
        "model": model_kind,
        "epsilon": epsilon,
        "seeds": repeats,
        "acc_ours": float(accuracy.mean()),
        "s_epoch_ours": min(r.seconds / settings.epochs for r in ours),
        "s_epoch_secure": secure_seconds_per_epoch(records, ours[0]),
        "sigma_ours": ours[0].config.noise_multiplier,
        "eps_ours": ours[0].epsilon_spent,
    }
    if not peer:
        return row
    theirs = np.array([p.accuracy for p in peer])
    first = peer[0]
    row.update(
        acc_opacus=float(theirs.mean()),
        acc_diff_points=100.0 * float(accuracy.mean() - theirs.mean()),
        diff_se_points=100.0
        * math.sqrt(
            (accuracy.var(ddof=1) + theirs.var(ddof=1)) / repeats if repeats > 1 else math.nan
        ),
        s_epoch_opacus=min(p.seconds_per_epoch for p in peer),
        sigma_opacus=first.noise_multiplier,
        eps_opacus=first.epsilon,
        eps_ours_pld_on_opacus=gaussian_epsilon(
            first.noise_multiplier, first.sample_rate, first.steps, args.delta, "pld"
        ),
        eps_ours_rdp_on_opacus=gaussian_epsilon(
            first.noise_multiplier, first.sample_rate, first.steps, args.delta, "rdp"
        ),
    )
    row["speedup"] = row["s_epoch_opacus"] / row["s_epoch_ours"]
    return row


def warm_up(records: Records, args: argparse.Namespace) -> None:
    """One untimed epoch of each model on each side, so that no library's first call
    (imports, allocations, torch's kernel selection) is counted in a timed epoch."""
    settings = settings_for(records.name, epochs=1)
    for model_kind in args.models.split(","):
        opacus_run(records, model_kind, 8.0, settings, args.delta, 0)
        run_dpsgd(records, model_kind, 8.0, settings, args.delta, "rdp", 0)


def misses(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The targets a row does not meet."""
    out = []
    for row in rows:
        if "acc_opacus" not in row:
            continue
        where = f"{row['dataset']} {row['model']} epsilon {row['epsilon']:g}"
        if abs(row["acc_diff_points"]) > ACCURACY_TARGET_POINTS:
            out.append(
                f"{where}: accuracy {row['acc_ours']:.4f} vs Opacus {row['acc_opacus']:.4f} "
                f"({row['acc_diff_points']:+.2f} points; target within {ACCURACY_TARGET_POINTS:g})"
            )
        if row["model"] == "logistic" and row["speedup"] < SPEEDUP_TARGET:
            out.append(
                f"{where}: {row['speedup']:.2f}x Opacus's speed (target {SPEEDUP_TARGET:g}x)"
            )
    return out


COLUMNS = [
    "dataset", "model", "epsilon", "seeds", "acc_ours", "acc_opacus", "acc_diff_points",
    "diff_se_points",
    "s_epoch_ours", "s_epoch_secure", "s_epoch_opacus", "speedup", "sigma_ours",
    "sigma_opacus", "eps_ours", "eps_opacus", "eps_ours_pld_on_opacus", "eps_ours_rdp_on_opacus",
]  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.benchmarks.dpsgd_bench",
        description="DP-SGD against Opacus: accuracy, seconds per epoch, epsilon.",
    )
    parser.add_argument("--datasets", default="digits,synthetic", help="comma-separated")
    parser.add_argument("--models", default="logistic,mlp", help="comma-separated")
    parser.add_argument("--epsilons", default="1,3,8", help="comma-separated")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument(
        "--repeats", type=int, help="seeds per setting (default: 10 on digits, 3 on synthetic)"
    )
    parser.add_argument("--epochs", type=int, help="epochs (default: per dataset)")
    parser.add_argument("--records", type=int, default=100_000, help="synthetic records")
    parser.add_argument(
        "--torch-threads", type=int, default=1,
        help="torch's intra-op threads (1: Opacus's fastest here on these small models)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="digits only, one seed")
    args = parser.parse_args(argv)
    if args.quick:
        args.datasets, args.repeats = "digits", 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)  # RDP orders it skips, each logged
    args.peer_problem = opacus_available()
    if args.peer_problem is not None:
        print(f"Opacus is not available ({args.peer_problem}): its columns are skipped")
    else:
        import torch

        torch.set_num_threads(args.torch_threads)
    rows = []
    for dataset in args.datasets.split(","):
        records = load_records(dataset, 0, args.records)
        print(f"{dataset}: {len(records.train_x)} training records", file=sys.stderr)
        if args.peer_problem is None:
            warm_up(records, args)
        for model_kind in args.models.split(","):
            for epsilon in (float(e) for e in args.epsilons.split(",")):
                rows.append(compare(records, model_kind, epsilon, args))
                print(f"  {model_kind} epsilon {epsilon:g} done", file=sys.stderr)
    print(report.format_table(rows, COLUMNS))
    missed = misses(rows)
    for line in missed:
        print(f"  MISS {line}")
    if not missed and args.peer_problem is None:
        print("all targets met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
