"""The capture buffers' layout: the one source of the numbers that the Python
capture, the native capture (_capture.c) and the Arrow conversion share.

setup.py compiles _capture.c with these values as macros (``-DVALUE_WIDTH=7``, ...)
read from this file, and the native module reports them back at import, where
capture.py refuses a module built with other numbers. This file imports nothing,
so setup.py can read it before anything is installed."""

# A value header: kind, i, dtype id, device id, shape length, data length, name id.
VALUE_WIDTH = 7
# A row: seq, parent, depth, target id, method id, t0, t1, exception id, three counters,
# the counter reads folded into it (their pattern and how many; see FOLD_MAX), and an
# empty free group folded into it (after how many of those reads, -1: none; the targets
# of its nested calls), and the bounds of a free group around it folded into it (see
# GROUP_OPENED; their nested calls' targets).
ROW_WIDTH = 17
ROW_FOLD_PATTERN, ROW_FOLD_COUNT, ROW_GROUP_AT, ROW_GROUP_TARGETS = 11, 12, 13, 14
ROW_BOUNDS, ROW_BOUNDS_TARGETS = 15, 16
# Counter reads that return what the recorder already knows (the pool's state has not
# changed since it last saw that counter) are folded into the row before them instead
# of becoming rows: the pattern of counters read (base-4 digits, counter slot + 1, the
# first read in the lowest digit) repeats, cut at the fold's count. At most FOLD_MAX
# distinct reads make a pattern.
FOLD_MAX = 8  # the trace format's own (trace.format.FOLD_MAX; a test holds them equal)
# A free group opened and closed with nothing freed in it changes nothing, yet a
# scheduler does it after every batch: such a pair (and the same pair it makes on its
# sub-allocators) folds into the row before it as well, one per row. Its nested calls'
# targets are packed as name ids + 1, GROUP_TARGET_BITS bits each, first in the lowest
# bits; a pair with more nested calls, or a name id past the bits, stays as rows.
GROUP_NESTED_MAX = 3
GROUP_TARGET_BITS = 16
# A free group that does hold calls (a scheduler frees one finished request's tokens in
# most of its groups) loses its begin and end rows the same way: the begin (and its
# nested begins) folds into the first call in the group, the end (and its nested ends)
# into the last, when nothing else came between. ROW_BOUNDS holds the bits (0: none); the
# end's counters, read as its row would have read them, go into that row's counters.
GROUP_OPENED, GROUP_CLOSED = 1, 2

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
             "K_SEGMENTS", "K_OPAQUE", "ROW_FOLD_PATTERN", "ROW_FOLD_COUNT", "ROW_GROUP_AT", "ROW_GROUP_TARGETS",
             "ROW_BOUNDS", "ROW_BOUNDS_TARGETS", "GROUP_OPENED", "GROUP_CLOSED", "FOLD_MAX", "GROUP_NESTED_MAX",
             "GROUP_TARGET_BITS",
             "FINISH_CALL", "FINISH_READ", "FINISH_GROUP_BEGIN", "FINISH_GROUP_END"]
    values = globals()
    return [(n, str(values[n])) for n in names]
