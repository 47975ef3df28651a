"""One step at run time: the prefix K/V cache, the reuse context the Megatron hooks read, and
`ReuseStep` (batch + plan + schedule + cache, and the data-iterator protocol)."""
