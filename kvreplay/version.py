"""kvreplay's version: stored with every run and every trace it records."""

__version__ = "0.2.0"
