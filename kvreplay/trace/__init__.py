"""The trace contract: the Parquet format, reading it back, pool-state snapshots,
summaries and content hashes. Everything that writes or reads a trace uses these."""
