"""The jobs: work a command asks for that spans replays and the store (bisect, matrix,
minimize and its reproducer, the demo, the dashboard, the watch, a stored replay).

Jobs sit above the families and the replay machinery and below the command line; each
module is one job. They ask a family's record, never a family's name."""
