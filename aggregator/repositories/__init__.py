"""The aggregator's repositories: each table group behind one class, over one ``Database``.

| module | repository | tables |
|---|---|---|
| ``metrics`` | ``MetricsRepository`` | ``metric_versions`` (and the change token) |
| ``keys`` | ``KeysRepository`` | ``api_keys`` |
| ``reports`` | ``ReportsRepository`` | ``report_ids``, ``partial_stats`` |
| ``tasks`` | ``TasksRepository`` | ``federated_tasks``, ``federated_updates`` |
| ``secagg`` | ``SecAggRepository`` | ``secagg_*``: a secure round's messages |

``database`` holds the engine, the schema's creation and upgrades, and the read and
write transactions every repository runs in; ``schema`` the tables. A repository is
built over a ``Database`` and tested alone; ``aggregator.storage.Repositories`` holds
the four of them over one database, one set per process; ``aggregator.federated.Federated``
builds the ``SecAggRepository`` over the tasks repository's database.
"""
