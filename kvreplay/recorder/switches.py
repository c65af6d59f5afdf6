"""What turns recording on in a process: the environment variables ``kvreplay record``
sets for every process of the recorded program, and the directory it puts first on
their PYTHONPATH (its sitecustomize starts autorecord.py). Imports nothing of
kvreplay, so the writer process can leave both out of its own environment."""

from pathlib import Path

DIR_ENV = "KVREPLAY_RECORD_DIR"
CLASSES_ENV = "KVREPLAY_RECORD_CLASSES"
RANK_ENV = "KVREPLAY_RANK"
FLIGHT_ENV = "KVREPLAY_FLIGHT"  # N: flight recorders keeping the last N calls, dumped on a raise or SIGUSR2
COUNTERS_ENV = "KVREPLAY_COUNTERS_EVERY"  # N: read the pool's counters after every Nth call (0: never)
WATCH_ENV = "KVREPLAY_WATCH"  # check: the writer checks invariants as it writes (jobs/watch.py); metrics: counts only
FINDINGS_FILE = "kvreplay-watch.jsonl"  # in the trace directory: what watching writers found, a JSON line each
METRICS_GLOB = ".kvreplay-metrics-*.json"  # there too: each watching writer's counters, rewritten about once a second
FOLD_ENV = "KVREPLAY_FOLD_READS"  # 0: every call a row of its own, reads and empty groups too (format 1's rows)
CHECKPOINT_ENV = "KVREPLAY_CHECKPOINT_EVERY"  # N: a checkpoint every N calls (replay --jobs splits there)
PARTS_ENV = "KVREPLAY_PARTS"  # ROWS,SECONDS,KEEP_PARTS,KEEP_BYTES: a trace is a directory of parts (rotation.py)
SEAL_ENV = "KVREPLAY_WATCH_KEY"  # this run's key: its writers seal each finding and counter file with it (seal.py)
CPUS_ENV = "KVREPLAY_CPUS"  # the CPUs kvreplay record may use: its recorder threads go back to them
SITE_DIR = Path(__file__).with_name("_site")
