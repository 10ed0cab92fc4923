"""Sharded checkpoints through torch.distributed.checkpoint (DCP): the storage writer (``writer``: its
files, their commit and the removal of what they replace), the verified reader (``reader``), the saver
of a cached layout (``saver``), the plan cache (``plan_cache``), the lazy snapshot of an asynchronous
save (``snapshot``), the metadata template (``metadata_template``) and the helpers that save and load
a training state's shards (``sharded_state``)."""
