"""Not imported as a package: ``kvreplay record`` puts this directory on PYTHONPATH so
every Python process of the recorded program runs its ``sitecustomize``."""
