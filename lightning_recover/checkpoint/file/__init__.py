"""Single-file checkpoints, format 2 only: the torch.save-compatible archive (``torch_zip``), save and load
(``single_file``), the asynchronous save (``async_io``), the verified reads of a load (``storage_reads``), the
population of fresh storages' pages beside them (``page_populate``), and the tensors of a state by path
(``state_tensors``)."""
