"""Replaying a trace on a build: the replayer, its report, comparison, remap,
git-build workers and differential replay."""
