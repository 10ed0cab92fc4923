"""Single-file checkpoints: the torch.save-compatible archive (``torch_zip``), save and load
(``single_file``), the asynchronous save (``async_io``), the verified reads of a load
(``storage_reads``) and the population of fresh storages' pages beside them (``page_populate``)."""
