"""Federated learning with differential privacy: models, FedAvg, privacy modes, tasks.

* :mod:`shared.federated.models`: the model interface (a flat parameter vector and its
  loss) and the built-in numpy models with per-example gradients, local SGD.
* :mod:`shared.federated.dpsgd`: DP-SGD (Abadi et al. 2016) over one holder's records:
  Poisson sampling, per-example clipping, Gaussian noise, accounting.
* :mod:`shared.federated.fedavg`: plain federated averaging with server momentum.
* :mod:`shared.federated.privacy`: clipping, Gaussian noise, the ``none``, ``local``,
  ``central``, ``distributed`` and ``silo`` (record-level, DP-SGD in each silo) modes
  wrapped around FedAvg, adaptive clipping.
* :mod:`shared.federated.task`: a task's configuration, noise calibration and state,
  shared by the aggregator service and the simulation.

Everything here is numpy only, so the device imports it as freely as the server.
"""
