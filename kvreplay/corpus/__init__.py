"""A saved corpus of traces with their expectations: the manifest, ``kvreplay ci``,
``corpus add``/``check`` and the pytest plugin."""
