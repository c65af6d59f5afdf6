"""Pool families and engines: one record each (record.py), listed in registry.py;
a family's own code lives in its folder here."""
