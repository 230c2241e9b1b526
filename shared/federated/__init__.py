"""Federated learning with differential privacy: models, FedAvg, privacy modes, tasks.

* :mod:`shared.federated.models`: the model interface (a flat parameter vector and its
  loss) and the built-in numpy models, local SGD.
* :mod:`shared.federated.fedavg`: plain federated averaging with server momentum.
* :mod:`shared.federated.privacy`: clipping, Gaussian noise, the ``none``, ``local``,
  ``central`` and ``distributed`` modes wrapped around FedAvg, adaptive clipping.
* :mod:`shared.federated.task`: a task's configuration, noise calibration and state,
  shared by the aggregator service and the simulation.

Everything here is numpy only, so the device imports it as freely as the server.
"""
