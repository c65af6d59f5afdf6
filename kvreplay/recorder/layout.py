"""The capture buffers' layout: the one source of the numbers that the Python
capture, the native capture (_capture.c) and the Arrow conversion share.

setup.py compiles _capture.c with these values as macros (``-DVALUE_WIDTH=7``, ...)
read from this file, and the native module reports them back at import, where
capture.py refuses a module built with other numbers. This file imports nothing,
so setup.py can read it before anything is installed."""

# A value header: kind, i, dtype id, device id, shape length, data length, name id.
VALUE_WIDTH = 7
# A row: seq, parent, depth, target id, method id, t0, t1, exception id, three counters,
# and the counter reads folded into it (their pattern and how many; see FOLD_MAX).
ROW_WIDTH = 13
ROW_FOLD_PATTERN, ROW_FOLD_COUNT = 11, 12
# Counter reads that return what the recorder already knows (the pool's state has not
# changed since it last saw that counter) are folded into the row before them instead
# of becoming rows: the pattern of counters read (base-4 digits, counter slot + 1, the
# first read in the lowest digit) repeats, cut at the fold's count. At most FOLD_MAX
# distinct reads make a pattern.
FOLD_MAX = 8  # the trace format's own (trace.format.FOLD_MAX; a test holds them equal)

# Value kind codes: positions in trace.format.VALUE_KINDS.
K_NONE, K_BOOL, K_INT, K_FLOAT, K_STR, K_TENSOR, K_INTS, K_SEGMENTS, K_OPAQUE = range(9)
# In capture buffers only: a tensor whose elements are still on their way from the
# device; its object (``device_values()``) delivers them.
K_DEFERRED = 9

# How a wrapped method's row ends.
FINISH_CALL, FINISH_READ, FINISH_GROUP_BEGIN, FINISH_GROUP_END = range(4)


def c_macros() -> list[tuple[str, str]]:
    """The constants above as C macro definitions, for setup.py."""
    names = ["VALUE_WIDTH", "ROW_WIDTH", "K_NONE", "K_BOOL", "K_INT", "K_FLOAT", "K_STR", "K_TENSOR", "K_INTS",
             "K_SEGMENTS", "K_OPAQUE", "ROW_FOLD_PATTERN", "ROW_FOLD_COUNT", "FOLD_MAX",
             "FINISH_CALL", "FINISH_READ", "FINISH_GROUP_BEGIN", "FINISH_GROUP_END"]
    values = globals()
    return [(n, str(values[n])) for n in names]
