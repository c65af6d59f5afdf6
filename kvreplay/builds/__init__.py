"""Builds: what a ``--build`` names, and how a pool of it is made (builtin pools,
importable classes, the installed sglang, git revisions)."""
