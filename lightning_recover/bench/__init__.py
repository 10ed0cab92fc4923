"""What ``lightning-recover bench`` runs, to compare on your own hardware: ``checkpoint`` (durable save
and cold load against the stock IOs and fio; ``--ranks``: sharded DCP saves, ``dcp_ranks.py``),
``async`` (``async_checkpoint.py``), ``recovery`` and ``overhead`` (``recovery.py`` over
``fabric_gpt.py``), ``resilience`` (``resilience.py`` over ``resilience_train.py``) and ``scale``
(``scale.py`` over ``stand_in_data_plane.py`` and ``etcd_metrics.py``); ``gpt_state.py`` builds the states,
``fio.py`` runs the device reference. The peers' harnesses (torchft) and the research and profiling scripts
live in the repository's ``benchmarks/``, outside the package."""
