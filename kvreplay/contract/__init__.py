"""What a pool family is: its record (record.py: a family and its engine, as data) and
the registry of the families there are (registry.py). The families themselves, each
in a folder of its own, live in kvreplay/families/."""
