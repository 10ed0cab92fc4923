"""The Lightning adapters: ``Fabric(strategy="recover")`` and ``Trainer(strategy="recover")``.

``fabric`` and ``trainer`` hold the two strategies, ``base`` what they share (options, launch,
writer election), ``ranks`` how Lightning's ranks map onto live replicas, ``loader`` the Trainer's
one-token-per-step loader and ``step_logs`` the per-step aggregation of ``self.log``.
"""
