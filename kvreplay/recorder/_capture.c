/* Native call capture for the kvreplay recorder.
 *
 * The pure-Python recorder (capture.py) spends about 2.5 us of interpreter work on
 * every allocator call before it copies a single value; on the decode-server model,
 * whose calls take ~35 us, that alone is a 1.1x slowdown. This module does the same
 * work in C: a callable that wraps one allocator method, keeps the call stack,
 * copies arguments and results of the common kinds (None, bool, int, contiguous
 * CPU integer tensors) straight into flat int64 buffers, reads the counters and
 * hands full buffers to Python. Every other value goes through the Python
 * encoder (py_buffers.encode), so both recorders write identical rows.
 *
 * Layout of the buffers is layout.py's: a row is ROW_WIDTH int64s, a value
 * VALUE_WIDTH; setup.py passes every layout constant in as a macro from there. Nothing here may raise into the recorded program: an internal error
 * is passed to the fail callback, which logs once and disables recording. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* From layout.py, through setup.py: never written here by hand. */
#if !defined(VALUE_WIDTH) || !defined(ROW_WIDTH) || !defined(K_OPAQUE) || !defined(FINISH_GROUP_END) \
    || !defined(ROW_FOLD_COUNT) || !defined(FOLD_MAX) || !defined(ROW_GROUP_AT) || !defined(GROUP_NESTED_MAX) \
    || !defined(ROW_BOUNDS) || !defined(GROUP_CLOSED)
#error "build _capture.c through setup.py, which defines the layout constants from kvreplay/recorder/layout.py"
#endif
#define MAX_DEPTH 64
#define NULL_COUNTER INT64_MIN
#define MAX_SCALAR_CODE 64 /* torch's ScalarType codes are below this */

/* element codes of integer dtypes, as set_dtypes receives them */
enum { E_INT64, E_INT32, E_INT16, E_INT8, E_UINT8, E_BOOL };

typedef struct {
    int64_t *p;
    Py_ssize_t len, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1024;
    while (cap < b->len + extra) cap *= 2;
    int64_t *p = PyMem_Realloc(b->p, (size_t)cap * sizeof(int64_t));
    if (!p) { PyErr_NoMemory(); return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_push(Buf *b, const int64_t *v, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->p + b->len, v, (size_t)n * sizeof(int64_t));
    b->len += n;
    return 0;
}

static PyObject *buf_bytes(Buf *b) {
    PyObject *out = PyBytes_FromStringAndSize((const char *)b->p, b->len * (Py_ssize_t)sizeof(int64_t));
    b->len = 0;
    return out;
}

typedef struct {
    Buf head, shape, data;
    PyObject *objs; /* list */
} Values;

typedef struct {
    PyObject_HEAD
    Values args, result;
    Buf rows, arg_count;
    PyObject *excs;       /* list of (type name, message) */
    PyObject *dtypes;     /* dict torch.dtype -> (id, element code) */
    PyObject *name_ids;   /* dict str -> id (Names._ids); misses go to name_id */
    PyObject *name_id;    /* callable str -> id */
    PyObject *slow_put;   /* callable value -> encoded tuple (row_batch.encode) */
    PyObject *counters;   /* tuple of 3 callables or None */
    Py_ssize_t counters_every, counter_tick; /* read them after every Nth eligible call (0: never) */
    PyObject *flush;      /* callable, called after a top-level row once rows >= flush_rows */
    PyObject *fail;       /* callable exc -> None */
    PyObject *raised;     /* callable or None: called after a top-level call that raised is recorded */
    int64_t cpu_id;
    Py_ssize_t flush_rows;
    int64_t flush_ns;     /* also flush once the oldest pending row is this old (0: never) */
    int64_t batch_t0;     /* when the oldest pending row finished */
    int64_t last_t1;      /* when the newest top-level row finished */
    int64_t next_seq;
    int depth;
    int64_t stack_target[MAX_DEPTH], stack_seq[MAX_DEPTH];
    int active, in_group;
    int in_flight; /* recorded calls between their first argument and their finished row */
    int64_t code_dtype[MAX_SCALAR_CODE]; /* shim scalar type code -> dtype id, -1: not an index dtype */
    int code_elem[MAX_SCALAR_CODE];
    int use_shim;
    /* Folding counter reads (layout.py): the counters' values as last seen since the
     * pool's state last changed, the row folds go into (its offset in rows, -1: none,
     * e.g. right after a take), and that row's pattern so far. */
    int fold_reads; /* 0: every read is a row (format version 1's way) */
    int64_t cur[3];
    int cur_ok[3];
    Py_ssize_t anchor;
    int pat[FOLD_MAX], plen, cycling;
    /* An empty free group folds too (layout.py): where the buffers stood before its
     * begin, the row it would fold into, what was known of the counters then, and the
     * begin's method id (group_anchor -1: no empty group may fold now). group_valid:
     * the mark stands (no call made in the group yet); group_mid stays the begin's
     * method id until the group ends (-1: no group whose bounds may fold). */
    Py_ssize_t group_mark[11], group_anchor;
    int64_t group_cur[3], group_mid;
    int group_cur_ok[3], group_valid;
} Capture;

typedef struct {
    PyObject_HEAD
    Capture *cap;
    PyObject *fn;
    PyObject *pids; /* tuple of int name ids of the positional parameters */
    PyObject *name;
    int64_t target, method;
    int finish;
    int slot; /* a counter read: its counter (0..2), else -1 */
    vectorcallfunc vectorcall;
} Wrapped;

static PyObject *s_dtype, *s_is_cpu, *s_is_contiguous, *s_dim, *s_numel, *s_data_ptr, *s_shape, *s_name;
static PyTypeObject *TensorType; /* torch.Tensor, set by set_tensor_type */

/* torch's stable C shim (the aoti_torch_* functions libtorch exports for compiled
 * models): reading a tensor's dtype, device, contiguity, size and data pointer through
 * it costs a few nanoseconds each, where the same six Python attribute reads and
 * method calls cost ~350 ns per tensor, most of the recorder's time on the decode
 * model. A tensor object holds its at::Tensor at a fixed offset; capture.py finds it
 * (checked against torch._C._tensor_impl_raw_handle), resolves the functions and
 * verifies them on sample tensors before handing them over with set_tensor_shim.
 * Without it (another torch, another platform) the Python reads are used. */
typedef int32_t (*shim_i32_fn)(void *, int32_t *);
typedef int32_t (*shim_i64_fn)(void *, int64_t *);
typedef int32_t (*shim_bool_fn)(void *, unsigned char *);
typedef int32_t (*shim_ptr_fn)(void *, void **);
typedef int32_t (*shim_sizes_fn)(void *, int64_t **);
static struct {
    int on;
    Py_ssize_t offset; /* of the at::Tensor inside a torch.Tensor object */
    shim_i32_fn dtype, device_type;
    shim_bool_fn is_contiguous;
    shim_i64_fn dim, numel;
    shim_ptr_fn data_ptr;
    shim_sizes_fn sizes;
    int32_t cpu_type;
    PyObject *codes; /* dict torch.dtype -> scalar type code */
} shim;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t call_int(PyObject *obj, PyObject *name, int *err) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (!r) { *err = 1; return 0; }
    int64_t v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred()) *err = 1;
    return v;
}

/* What a contiguous CPU integer tensor holds: where, how many, which dtype. */
typedef struct {
    int64_t dtype_id, nd, n;
    int elem;
    const void *src;
} TensorView;

/* tensor_view through torch's C shim: 1 (view filled) or 0, never an error. */
static int tensor_view_shim(Capture *c, PyObject *v, TensorView *tv) {
    void *h = (char *)v + shim.offset;
    int32_t code, dev;
    unsigned char contig;
    if (shim.dtype(h, &code) || code < 0 || code >= MAX_SCALAR_CODE || c->code_dtype[code] < 0) return 0;
    if (shim.device_type(h, &dev) || dev != shim.cpu_type) return 0;
    if (shim.is_contiguous(h, &contig) || !contig) return 0;
    void *ptr = NULL;
    if (shim.dim(h, &tv->nd) || shim.numel(h, &tv->n) || (tv->n && shim.data_ptr(h, &ptr))) return 0;
    tv->dtype_id = c->code_dtype[code];
    tv->elem = c->code_elem[code];
    tv->src = ptr;
    return 1;
}

/* Returns 1 when v is a contiguous CPU integer tensor (view filled), 0 when it needs
 * the Python encoder, -1 on error. */
static int tensor_view(Capture *c, PyObject *v, TensorView *tv) {
    if (!TensorType || !Py_IS_TYPE(v, TensorType)) return 0;
    if (c->use_shim) return tensor_view_shim(c, v, tv);
    PyObject *dt = PyObject_GetAttr(v, s_dtype);
    if (!dt) return -1;
    PyObject *entry = PyDict_GetItemWithError(c->dtypes, dt);
    Py_DECREF(dt);
    if (!entry) return PyErr_Occurred() ? -1 : 0;
    tv->dtype_id = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0));
    tv->elem = (int)PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));

    PyObject *cpu = PyObject_GetAttr(v, s_is_cpu);
    if (!cpu) return -1;
    int is_cpu = cpu == Py_True;
    Py_DECREF(cpu);
    if (!is_cpu) return 0;
    PyObject *contig = PyObject_CallMethodNoArgs(v, s_is_contiguous);
    if (!contig) return -1;
    int is_contig = contig == Py_True;
    Py_DECREF(contig);
    if (!is_contig) return 0;

    int err = 0;
    tv->nd = call_int(v, s_dim, &err);
    tv->n = err ? 0 : call_int(v, s_numel, &err);
    int64_t ptr = (err || tv->n == 0) ? 0 : call_int(v, s_data_ptr, &err);
    tv->src = (const void *)(intptr_t)ptr;
    return err ? -1 : 1;
}

static int copy_elements(Buf *data, const TensorView *tv) {
    int64_t n = tv->n;
    if (buf_reserve(data, n) < 0) return -1;
    int64_t *out = data->p + data->len;
    const void *src = tv->src;
    switch (tv->elem) {
    case E_INT64: if (n) memcpy(out, src, (size_t)n * 8); break;
    case E_INT32: for (int64_t j = 0; j < n; j++) out[j] = ((const int32_t *)src)[j]; break;
    case E_INT16: for (int64_t j = 0; j < n; j++) out[j] = ((const int16_t *)src)[j]; break;
    case E_INT8: for (int64_t j = 0; j < n; j++) out[j] = ((const int8_t *)src)[j]; break;
    case E_UINT8: for (int64_t j = 0; j < n; j++) out[j] = ((const uint8_t *)src)[j]; break;
    default: for (int64_t j = 0; j < n; j++) out[j] = ((const uint8_t *)src)[j] != 0; break;
    }
    data->len += n;
    return 0;
}

static int put_tensor(Capture *c, Values *vals, PyObject *v, int64_t name) {
    TensorView tv;
    int ok = tensor_view(c, v, &tv);
    if (ok <= 0) return ok;
    if (tv.nd != 1 && c->use_shim) {
        int64_t *sizes;
        if (shim.sizes((char *)v + shim.offset, &sizes)) return 0;
        if (buf_push(&vals->shape, sizes, tv.nd) < 0) return -1;
    } else if (tv.nd != 1) {
        PyObject *shape = PyObject_GetAttr(v, s_shape);
        if (!shape) return -1;
        PyObject *seq = PySequence_Fast(shape, "shape");
        Py_DECREF(shape);
        if (!seq) return -1;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
        if (buf_reserve(&vals->shape, k) < 0) { Py_DECREF(seq); return -1; }
        for (Py_ssize_t j = 0; j < k; j++) {
            vals->shape.p[vals->shape.len + j] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, j));
        }
        vals->shape.len += k;
        Py_DECREF(seq);
    }
    int64_t h[VALUE_WIDTH] = {K_TENSOR, 0, tv.dtype_id, c->cpu_id, tv.nd, tv.n, name};
    if (buf_push(&vals->head, h, VALUE_WIDTH) < 0 || copy_elements(&vals->data, &tv) < 0) return -1;
    return 1;
}

/* A list of (tensor, start) segments, as free_segments takes them, when every tensor
 * is a contiguous CPU tensor of one dtype. Returns 1 done, 0 not this shape, -1 error. */
#define MAX_FAST_SEGMENTS 256
static int put_segments(Capture *c, Values *vals, PyObject *v, int64_t name) {
    Py_ssize_t k = PySequence_Fast_GET_SIZE(v);
    if (k == 0 || k > MAX_FAST_SEGMENTS) return 0;
    TensorView tv[MAX_FAST_SEGMENTS];
    int64_t starts[MAX_FAST_SEGMENTS];
    int64_t total = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(v, j);
        if (!(PyTuple_CheckExact(pair) || PyList_CheckExact(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) return 0;
        PyObject *start = PySequence_Fast_GET_ITEM(pair, 1);
        if (!PyLong_CheckExact(start)) return 0;
        int ok = tensor_view(c, PySequence_Fast_GET_ITEM(pair, 0), &tv[j]);
        if (ok <= 0) return ok;
        if (tv[j].dtype_id != tv[0].dtype_id) return 0;
        int overflow = 0;
        starts[j] = PyLong_AsLongLongAndOverflow(start, &overflow);
        if (overflow || (starts[j] == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
        total += tv[j].n;
    }
    int64_t h[VALUE_WIDTH] = {K_SEGMENTS, 0, tv[0].dtype_id, c->cpu_id, 2 * k, total, name};
    if (buf_push(&vals->head, h, VALUE_WIDTH) < 0 || buf_reserve(&vals->shape, 2 * k) < 0) return -1;
    for (Py_ssize_t j = 0; j < k; j++) {
        vals->shape.p[vals->shape.len++] = tv[j].n;
        vals->shape.p[vals->shape.len++] = starts[j];
        if (copy_elements(&vals->data, &tv[j]) < 0) return -1;
    }
    return 1;
}

/* A list or tuple of plain ints, each within int64, as the encoder's K_INTS (vLLM's
 * wire sends block ids and hashes so, on every call); 0: not one. */
static int put_ints(Values *vals, PyObject *v, int64_t name) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    PyObject **items = PySequence_Fast_ITEMS(v);
    Py_ssize_t start = vals->data.len;
    if (buf_reserve(&vals->data, n) < 0) return -1;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (!PyLong_CheckExact(items[j])) return 0;
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(items[j], &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        vals->data.p[start + j] = x;
    }
    int64_t h[VALUE_WIDTH] = {K_INTS, PyTuple_CheckExact(v), -1, -1, 1, n, name};
    if (buf_push(&vals->head, h, VALUE_WIDTH) < 0) return -1;
    vals->data.len = start + n;
    return 1;
}

/* The Python encoder's tuple: (kind, i, dtype, device, nshape, n, shape extra, data bytes, obj). */
static int put_slow(Capture *c, Values *vals, PyObject *v, int64_t name) {
    PyObject *enc = PyObject_CallOneArg(c->slow_put, v);
    if (!enc) return -1;
    int rc = -1;
    if (!PyTuple_Check(enc) || PyTuple_GET_SIZE(enc) != 9) {
        PyErr_SetString(PyExc_TypeError, "encoder must return a 9-tuple");
        goto done;
    }
    int64_t h[VALUE_WIDTH];
    for (int k = 0; k < 6; k++) h[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(enc, k));
    h[6] = name;
    if (PyErr_Occurred()) goto done;
    PyObject *obj = PyTuple_GET_ITEM(enc, 8);
    if (obj != Py_None) {
        h[1] = PyList_GET_SIZE(vals->objs);
        if (PyList_Append(vals->objs, obj) < 0) goto done;
    }
    PyObject *extra = PyTuple_GET_ITEM(enc, 6);
    PyObject *data = PyTuple_GET_ITEM(enc, 7);
    if (!PyTuple_Check(extra) || !PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "encoder returned bad shape or data");
        goto done;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(extra);
    if (buf_reserve(&vals->shape, k) < 0) goto done;
    for (Py_ssize_t j = 0; j < k; j++) vals->shape.p[vals->shape.len + j] = PyLong_AsLongLong(PyTuple_GET_ITEM(extra, j));
    if (PyErr_Occurred()) goto done;
    vals->shape.len += k;
    if (buf_push(&vals->head, h, VALUE_WIDTH) < 0) goto done;
    if (buf_push(&vals->data, (const int64_t *)PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data) / 8) < 0) goto done;
    rc = 0;
done:
    Py_DECREF(enc);
    return rc;
}

static int put_value(Capture *c, Values *vals, PyObject *v, int64_t name) {
    if (v == Py_None) {
        int64_t h[VALUE_WIDTH] = {K_NONE, 0, -1, -1, 0, 0, name};
        return buf_push(&vals->head, h, VALUE_WIDTH);
    }
    if (PyBool_Check(v)) {
        int64_t h[VALUE_WIDTH] = {K_BOOL, v == Py_True, -1, -1, 0, 0, name};
        return buf_push(&vals->head, h, VALUE_WIDTH);
    }
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) return -1;
        if (!overflow) {
            int64_t h[VALUE_WIDTH] = {K_INT, x, -1, -1, 0, 0, name};
            return buf_push(&vals->head, h, VALUE_WIDTH);
        }
    } else if (TensorType && Py_IS_TYPE(v, TensorType)) {
        int done = put_tensor(c, vals, v, name);
        if (done != 0) return done < 0 ? -1 : 0;
    } else if (PyUnicode_CheckExact(v)) {
        int64_t h[VALUE_WIDTH] = {K_STR, PyList_GET_SIZE(vals->objs), -1, -1, 0, 0, name};
        if (PyList_Append(vals->objs, v) < 0) return -1;
        return buf_push(&vals->head, h, VALUE_WIDTH);
    } else if (PyList_CheckExact(v) || PyTuple_CheckExact(v)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
        int done = n == 0 || PyLong_CheckExact(PySequence_Fast_GET_ITEM(v, 0)) ? put_ints(vals, v, name)
                                                                                : put_segments(c, vals, v, name);
        if (done != 0) return done < 0 ? -1 : 0;
    }
    return put_slow(c, vals, v, name);
}

static int64_t kw_name_id(Capture *c, PyObject *key) {
    PyObject *id = PyDict_GetItemWithError(c->name_ids, key);
    if (id) return PyLong_AsLongLong(id);
    if (PyErr_Occurred()) return -1;
    PyObject *r = PyObject_CallOneArg(c->name_id, key);
    if (!r) return -1;
    int64_t out = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return out;
}

static int put_args(Capture *c, Wrapped *w, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t npids = PyTuple_GET_SIZE(w->pids);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nargs; j++) {
        int64_t name;
        if (j < npids) {
            name = PyLong_AsLongLong(PyTuple_GET_ITEM(w->pids, j));
        } else {
            PyObject *s = PyUnicode_FromFormat("arg%zd", j);
            if (!s) return -1;
            name = kw_name_id(c, s);
            Py_DECREF(s);
        }
        if (PyErr_Occurred() || put_value(c, &c->args, args[j], name) < 0) return -1;
    }
    for (Py_ssize_t j = 0; j < nkw; j++) {
        int64_t name = kw_name_id(c, PyTuple_GET_ITEM(kwnames, j));
        if (PyErr_Occurred() || put_value(c, &c->args, args[nargs + j], name) < 0) return -1;
    }
    int64_t count = nargs + nkw;
    return buf_push(&c->arg_count, &count, 1);
}

static void capture_reset(Capture *c) {
    c->args.head.len = c->args.shape.len = c->args.data.len = 0;
    c->result.head.len = c->result.shape.len = c->result.data.len = 0;
    c->rows.len = c->arg_count.len = 0;
    c->anchor = -1;
    c->group_anchor = -1;
    c->group_valid = 0;
    c->group_mid = -1;
    c->cur_ok[0] = c->cur_ok[1] = c->cur_ok[2] = 0;
    if (c->args.objs) PyList_SetSlice(c->args.objs, 0, PY_SSIZE_T_MAX, NULL);
    if (c->result.objs) PyList_SetSlice(c->result.objs, 0, PY_SSIZE_T_MAX, NULL);
    if (c->excs) PyList_SetSlice(c->excs, 0, PY_SSIZE_T_MAX, NULL);
}

/* Hand the pending error to the fail callback and stop recording; the recorded
 * program never sees it. */
static void capture_fail(Capture *c) {
    PyObject *tp, *exc, *tb;
    PyErr_Fetch(&tp, &exc, &tb);
    PyErr_NormalizeException(&tp, &exc, &tb);
    Py_XDECREF(tp);
    Py_XDECREF(tb);
    int was_active = c->active;
    c->active = 0;
    capture_reset(c);
    if (was_active && c->fail && exc) {
        PyObject *r = PyObject_CallOneArg(c->fail, exc);
        if (!r) PyErr_Clear();
        Py_XDECREF(r);
    }
    Py_XDECREF(exc);
}

static int read_counters(Capture *c, int64_t out[3]) {
    out[0] = out[1] = out[2] = NULL_COUNTER;
    if (!c->counters || c->counters == Py_None) return 0;
    c->active = 0; /* counter methods call each other; none of that is the program's call */
    int rc = 0;
    for (int k = 0; k < 3 && rc == 0; k++) {
        PyObject *f = PyTuple_GET_ITEM(c->counters, k);
        if (f == Py_None) continue;
        PyObject *r = PyObject_CallNoArgs(f);
        if (!r) { rc = -1; break; }
        PyObject *i = PyNumber_Index(r);
        Py_DECREF(r);
        if (!i) { rc = -1; break; }
        out[k] = PyLong_AsLongLong(i);
        Py_DECREF(i);
        if (out[k] == -1 && PyErr_Occurred()) rc = -1;
    }
    c->active = 1;
    return rc;
}

/* Can a read of counter `slot` go into the anchor row's fold? It can when it extends
 * the pattern (a counter not in it yet, before the pattern repeats) or is the next
 * read of the repeating pattern. Updates the fold when it does. */
static int fold(Capture *c, int slot) {
    int64_t *row = c->rows.p + c->anchor;
    int64_t n = row[ROW_FOLD_COUNT];
    if (n == 0) {
        c->plen = 0;
        c->cycling = 0;
    }
    if (c->cycling) {
        if (c->pat[n % c->plen] != slot) return 0;
    } else if (c->plen && c->pat[0] == slot) {
        c->cycling = 1;
    } else {
        for (int k = 0; k < c->plen; k++)
            if (c->pat[k] == slot) return 0;
        if (c->plen == FOLD_MAX) return 0;
        c->pat[c->plen++] = slot;
        int64_t packed = 0;
        for (int k = c->plen - 1; k >= 0; k--) packed = packed * 4 + c->pat[k] + 1;
        row[ROW_FOLD_PATTERN] = packed;
    }
    row[ROW_FOLD_COUNT] = n + 1;
    return 1;
}

/* What the recorder knows of the counters after a top-level row: a clean read tells
 * one counter; any other call changed the state, and only the counters read after it
 * (if any) are known. */
static void learn(Capture *c, Wrapped *w, PyObject *result, PyObject *exc, const int64_t counters[3]) {
    if (w->slot >= 0 && !exc && result && PyLong_CheckExact(result)) {
        int overflow = 0;
        int64_t v = PyLong_AsLongLongAndOverflow(result, &overflow);
        if (!overflow && !PyErr_Occurred()) {
            c->cur[w->slot] = v;
            c->cur_ok[w->slot] = 1;
            return;
        }
        PyErr_Clear();
    }
    for (int k = 0; k < 3; k++) {
        c->cur[k] = counters[k];
        c->cur_ok[k] = counters[k] != NULL_COUNTER;
    }
}

static void mark_buffers(Capture *c, Py_ssize_t m[11]) {
    Values *v[2] = {&c->args, &c->result};
    m[0] = c->rows.len;
    m[1] = c->arg_count.len;
    for (int k = 0; k < 2; k++) {
        m[2 + 4 * k] = v[k]->head.len;
        m[3 + 4 * k] = v[k]->shape.len;
        m[4 + 4 * k] = v[k]->data.len;
        m[5 + 4 * k] = PyList_GET_SIZE(v[k]->objs);
    }
    m[10] = PyList_GET_SIZE(c->excs);
}

static void forget_group(Capture *c) {
    c->group_anchor = -1;
    c->group_valid = 0;
    c->group_mid = -1;
}

/* A top-level free group begins with no arguments: mark where, for its folds. */
static void group_begins(Capture *c, Wrapped *w) {
    forget_group(c);
    if (!c->fold_reads) return;
    mark_buffers(c, c->group_mark);
    if (c->anchor >= 0 && c->rows.p[c->anchor + ROW_GROUP_AT] < 0) c->group_anchor = c->anchor;
    c->group_valid = 1;
    c->group_mid = w->method;
    for (int k = 0; k < 3; k++) {
        c->group_cur[k] = c->cur[k];
        c->group_cur_ok[k] = c->cur_ok[k];
    }
}

/* A row that raised nothing and holds no fold of any kind (capture.py's _plain). */
static int plain_row(const int64_t *r) {
    return r[7] < 0 && !r[ROW_FOLD_COUNT] && r[ROW_GROUP_AT] < 0 && !r[ROW_BOUNDS];
}

/* Nested calls' target ids packed as layout.py says, or -1 when they do not fit. */
static int64_t pack_targets(const int64_t *t, int n) {
    if (n > GROUP_NESTED_MAX) return -1;
    int64_t packed = 0;
    for (int k = n - 1; k >= 0; k--) {
        if (t[k] + 1 >= ((int64_t)1 << GROUP_TARGET_BITS)) return -1;
        packed = (packed << GROUP_TARGET_BITS) | (t[k] + 1);
    }
    return packed;
}

static int none_answers(Capture *c, Py_ssize_t start, Py_ssize_t count) {
    for (Py_ssize_t k = 0; k < count; k++)
        if (c->result.head.p[start + k * VALUE_WIDTH] != K_NONE) return 0;
    return 1;
}

/* Drop n int64s of a buffer from position at on. */
static void buf_cut(Buf *b, Py_ssize_t at, Py_ssize_t n) {
    memmove(b->p + at, b->p + at + n, (size_t)(b->len - at - n) * sizeof(int64_t));
    b->len -= n;
}

/* The packed targets of an empty group's nested calls from the rows put since the
 * mark (capture.py's empty_group_targets, the one definition in words), or -1. */
static int64_t empty_group_targets(Capture *c, int64_t end_mid) {
    Py_ssize_t *m = c->group_mark;
    for (Py_ssize_t k = m[1]; k < c->arg_count.len; k++)
        if (c->arg_count.p[k]) return -1;
    for (Py_ssize_t k = m[6]; k < c->result.head.len; k += VALUE_WIDTH)
        if (c->result.head.p[k] != K_NONE) return -1;
    int64_t before[GROUP_NESTED_MAX], after[GROUP_NESTED_MAX];
    int nb = 0, na = 0, top = 0;
    for (Py_ssize_t at = m[0]; at < c->rows.len; at += ROW_WIDTH) {
        const int64_t *r = c->rows.p + at;
        if (!plain_row(r)) return -1;
        if (r[2] == 0) {
            if (top || r[4] != c->group_mid) return -1;
            top = 1;
        } else if (r[2] == 1 && r[4] == (top ? end_mid : c->group_mid)) {
            if (top) {
                if (na == GROUP_NESTED_MAX) return -1;
                after[na++] = r[3];
            } else {
                if (nb == GROUP_NESTED_MAX) return -1;
                before[nb++] = r[3];
            }
        } else {
            return -1;
        }
    }
    if (!top || na != nb) return -1;
    for (int k = 0; k < nb; k++)
        if (before[k] != after[k]) return -1;
    return pack_targets(before, nb);
}

/* The call finishing now (its row not yet put) is the first in a free group: the
 * group's begin rows go when they may fold into its row (capture.py's opened_group,
 * the one definition in words). The packed targets of the begin's nested calls, or -1. */
static int64_t open_group(Capture *c) {
    Py_ssize_t *m = c->group_mark;
    const int64_t *p = c->rows.p;
    Py_ssize_t at = m[0], n = c->rows.len;
    int64_t before[GROUP_NESTED_MAX];
    int nb = 0;
    while (at < n && p[at + 2] == 1 && p[at + 4] == c->group_mid && plain_row(p + at)) {
        if (nb == GROUP_NESTED_MAX) return -1;
        before[nb++] = p[at + 3];
        at += ROW_WIDTH;
    }
    if (at >= n || p[at + 2] != 0 || p[at + 4] != c->group_mid || !plain_row(p + at)) return -1;
    for (Py_ssize_t r = at + ROW_WIDTH; r < n; r += ROW_WIDTH)
        if (p[r + 2] == 0) return -1;
    Py_ssize_t k = nb + 1; /* the begin and its nested begins */
    if (c->arg_count.len - m[1] < k || c->result.head.len - m[6] < k * VALUE_WIDTH) return -1;
    for (Py_ssize_t j = 0; j < k; j++)
        if (c->arg_count.p[m[1] + j]) return -1;
    if (!none_answers(c, m[6], k)) return -1;
    int64_t packed = pack_targets(before, nb);
    if (packed < 0) return -1;
    buf_cut(&c->rows, m[0], k * ROW_WIDTH);
    buf_cut(&c->arg_count, m[1], k);
    buf_cut(&c->result.head, m[6], k * VALUE_WIDTH);
    return packed;
}

/* The free group ending now (its end returned None, took no arguments) folds into the
 * row of the last call in it when nothing came between (capture.py's closed_group):
 * the end's counters, read as its row would have read them, go into that row. 1: folded,
 * 0: not, -1: an error (reading the counters raised). */
static int close_group(Capture *c, int64_t end_mid) {
    if (!c->in_group || c->group_mid < 0) return 0;
    Py_ssize_t a = c->anchor;
    int64_t *p = c->rows.p;
    if (a < 0 || p[a + 4] == c->group_mid || p[a + 7] >= 0 || p[a + ROW_FOLD_COUNT] || p[a + ROW_GROUP_AT] >= 0
        || (p[a + ROW_BOUNDS] & GROUP_CLOSED))
        return 0;
    int64_t after[GROUP_NESTED_MAX];
    int na = 0;
    for (Py_ssize_t at = a + ROW_WIDTH; at < c->rows.len; at += ROW_WIDTH) {
        if (p[at + 2] != 1 || p[at + 4] != end_mid || !plain_row(p + at) || na == GROUP_NESTED_MAX) return 0;
        after[na++] = p[at + 3];
    }
    Py_ssize_t k = na;
    if (c->arg_count.len < k + 1) return 0;
    for (Py_ssize_t j = c->arg_count.len - k - 1; j < c->arg_count.len; j++)
        if (c->arg_count.p[j]) return 0;
    if (!none_answers(c, c->result.head.len - k * VALUE_WIDTH, k)) return 0;
    int64_t packed = pack_targets(after, na);
    if (packed < 0 || ((p[a + ROW_BOUNDS] & GROUP_OPENED) && p[a + ROW_BOUNDS_TARGETS] != packed)) return 0;
    c->rows.len -= k * ROW_WIDTH;
    c->arg_count.len -= k + 1;
    c->result.head.len -= k * VALUE_WIDTH;
    c->in_group = 0;
    forget_group(c);
    int64_t counters[3] = {NULL_COUNTER, NULL_COUNTER, NULL_COUNTER};
    if (c->counters_every > 0 && ++c->counter_tick >= c->counters_every) {
        c->counter_tick = 0;
        if (read_counters(c, counters) < 0) return -1;
    }
    p = c->rows.p + a;
    for (int j = 0; j < 3; j++) {
        p[8 + j] = counters[j];
        c->cur[j] = counters[j];
        c->cur_ok[j] = counters[j] != NULL_COUNTER;
    }
    p[ROW_BOUNDS] |= GROUP_CLOSED;
    p[ROW_BOUNDS_TARGETS] = packed;
    c->last_t1 = now_ns();
    return 1;
}

/* The free group ending now folds into the row before its begin when nothing
 * happened in it; the buffers go back to where they stood before the begin. */
static int fold_group(Capture *c, int64_t end_mid) {
    if (!c->group_valid || c->group_anchor < 0) return 0;
    Py_ssize_t anchor = c->group_anchor;
    c->group_anchor = -1;
    c->group_valid = 0;
    int64_t targets = empty_group_targets(c, end_mid);
    if (targets < 0) return 0;
    Py_ssize_t *m = c->group_mark;
    Values *v[2] = {&c->args, &c->result};
    c->rows.len = m[0];
    c->arg_count.len = m[1];
    for (int k = 0; k < 2; k++) {
        v[k]->head.len = m[2 + 4 * k];
        v[k]->shape.len = m[3 + 4 * k];
        v[k]->data.len = m[4 + 4 * k];
        PyList_SetSlice(v[k]->objs, m[5 + 4 * k], PY_SSIZE_T_MAX, NULL);
    }
    PyList_SetSlice(c->excs, m[10], PY_SSIZE_T_MAX, NULL);
    int64_t *row = c->rows.p + anchor;
    row[ROW_GROUP_AT] = row[ROW_FOLD_COUNT];
    row[ROW_GROUP_TARGETS] = targets;
    c->anchor = anchor;
    for (int k = 0; k < 3; k++) {
        c->cur[k] = c->group_cur[k];
        c->cur_ok[k] = c->group_cur_ok[k];
    }
    c->in_group = 0;
    /* it counts towards counters_every as its row would have (its counters are the
     * ones known before the group: it changed nothing) */
    if (c->counters_every > 0 && ++c->counter_tick >= c->counters_every) c->counter_tick = 0;
    return 1;
}

static int finish_row(Capture *c, Wrapped *w, int64_t seq, int64_t parent, int64_t t0, PyObject *result,
                      PyObject *exc) {
    int64_t t1 = now_ns();
    int top = c->depth == 0;
    if (top && (w->finish == FINISH_GROUP_BEGIN || w->finish == FINISH_GROUP_END)) {
        c->in_group = w->finish == FINISH_GROUP_BEGIN && exc == NULL;
        if (w->finish == FINISH_GROUP_END) forget_group(c);
    }
    int64_t counters[3] = {NULL_COUNTER, NULL_COUNTER, NULL_COUNTER};
    if (top && !c->in_group && w->finish != FINISH_READ && c->counters_every > 0
        && ++c->counter_tick >= c->counters_every) {
        c->counter_tick = 0;
        if (read_counters(c, counters) < 0) return -1;
    }
    int64_t opened = -1;
    if (top && c->in_group && w->finish < FINISH_GROUP_BEGIN && c->group_valid) {
        if (!exc) opened = open_group(c);
        c->group_valid = 0;
    }
    if (put_value(c, &c->result, result ? result : Py_None, -1) < 0) return -1;
    int64_t exc_id = -1;
    if (exc) {
        PyObject *tp_name = PyObject_GetAttr((PyObject *)Py_TYPE(exc), s_name);
        PyObject *msg = tp_name ? PyObject_Str(exc) : NULL;
        PyObject *short_msg = msg ? PyUnicode_Substring(msg, 0, 1000) : NULL;
        PyObject *pair = short_msg ? PyTuple_Pack(2, tp_name, short_msg) : NULL;
        Py_XDECREF(tp_name);
        Py_XDECREF(msg);
        Py_XDECREF(short_msg);
        if (!pair) return -1;
        exc_id = PyList_GET_SIZE(c->excs);
        int bad = PyList_Append(c->excs, pair);
        Py_DECREF(pair);
        if (bad < 0) return -1;
    }
    int64_t row[ROW_WIDTH] = {seq, parent, c->depth, w->target, w->method, t0, t1, exc_id,
                              counters[0], counters[1], counters[2], 0, 0, -1, 0, 0, 0};
    if (top && opened >= 0) {
        row[ROW_BOUNDS] = GROUP_OPENED;
        row[ROW_BOUNDS_TARGETS] = opened;
    }
    if (c->rows.len == 0) c->batch_t0 = t1;
    if (buf_push(&c->rows, row, ROW_WIDTH) < 0) return -1;
    if (!top) return 0;
    c->last_t1 = t1;
    c->anchor = c->rows.len - ROW_WIDTH;
    learn(c, w, result, exc, counters);
    if (exc && c->raised && c->raised != Py_None) {
        PyObject *r = PyObject_CallNoArgs(c->raised);
        if (!r) return -1;
        Py_DECREF(r);
        return 0;
    }
    if (c->rows.len >= c->flush_rows * ROW_WIDTH && c->flush) {
        PyObject *r = PyObject_CallNoArgs(c->flush);
        if (!r) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* A batch old enough goes to the writer before a state-changing top-level call
 * starts (outside a group), not after some row: the calls that fold into a row (reads,
 * an empty group) follow it, so a batch that ends right after a row would leave them
 * nothing to fold into. */
static int flush_if_old(Capture *c, Wrapped *w) {
    if (c->flush_ns <= 0 || c->rows.len == 0 || c->in_group || !c->flush
        || (w->finish != FINISH_CALL && w->finish != FINISH_GROUP_BEGIN))
        return 0;
    /* A group's begin may fold into the row before it: it goes first only when the batch
     * is much older (a program that makes nothing but free groups still flushes). */
    int64_t age = now_ns() - c->batch_t0;
    if (age < (w->finish == FINISH_GROUP_BEGIN ? 5 * c->flush_ns : c->flush_ns)) return 0;
    PyObject *r = PyObject_CallNoArgs(c->flush);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *wrapped_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Wrapped *w = (Wrapped *)self;
    Capture *c = w->cap;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    /* A call the pool makes on itself (SWA free calling free_swa) is not a new row. */
    if (!c->active || (c->depth && c->stack_target[c->depth - 1] == w->target) || c->depth >= MAX_DEPTH) {
        return PyObject_Vectorcall(w->fn, args, nargsf, kwnames);
    }
    if (c->depth == 0 && flush_if_old(c, w) < 0) {
        capture_fail(c);
        return PyObject_Vectorcall(w->fn, args, nargsf, kwnames);
    }
    int64_t seq = c->next_seq++;
    int64_t parent = c->depth ? c->stack_seq[c->depth - 1] : -1;
    /* A top-level counter read that may fold: it needs no arguments and no row unless
     * its value turns out to be news. */
    int may_fold = c->fold_reads && w->slot >= 0 && c->depth == 0 && nargs == 0 && !kwnames && c->anchor >= 0 && c->cur_ok[w->slot];
    if (w->finish == FINISH_GROUP_BEGIN && c->depth == 0) {
        if (nargs || kwnames) forget_group(c);
        else group_begins(c, w);
    }
    /* From its first argument to its finished row a call is in flight: take_if_idle
     * from another thread must not split it (counter reads in finish_row run Python
     * code, where the GIL can pass to that thread). */
    c->in_flight++;
    if (put_args(c, w, args, nargs, kwnames) < 0) {
        c->in_flight--;
        capture_fail(c);
        return PyObject_Vectorcall(w->fn, args, nargsf, kwnames);
    }
    c->stack_target[c->depth] = w->target;
    c->stack_seq[c->depth] = seq;
    c->depth++;
    int64_t t0 = now_ns();
    PyObject *result = PyObject_Vectorcall(w->fn, args, nargsf, kwnames);
    c->depth--;
    if (!c->active) { /* disabled while this call was in progress */
        c->in_flight--;
        return result;
    }
    if (may_fold && result && PyLong_CheckExact(result) && c->anchor >= 0 && c->cur_ok[w->slot]
        && c->next_seq == seq + 1) {
        int overflow = 0;
        int64_t v = PyLong_AsLongLongAndOverflow(result, &overflow);
        if (!overflow && v == c->cur[w->slot] && fold(c, w->slot)) {
            c->arg_count.len--; /* its (empty) arguments were put: a folded read has none */
            c->in_flight--;
            return result;
        }
        if (PyErr_Occurred()) PyErr_Clear();
    }
    if (result == Py_None && w->finish == FINISH_GROUP_END && c->depth == 0 && nargs == 0 && !kwnames) {
        int folded = fold_group(c, w->method);
        if (!folded) folded = close_group(c, w->method);
        if (folded) {
            c->in_flight--;
            if (folded < 0) capture_fail(c);
            return result;
        }
    }
    if (result) {
        int bad = finish_row(c, w, seq, parent, t0, result, NULL) < 0;
        c->in_flight--;
        if (bad) capture_fail(c);
        return result;
    }
    PyObject *tp, *exc, *tb;
    PyErr_Fetch(&tp, &exc, &tb);
    PyErr_NormalizeException(&tp, &exc, &tb);
    if (tb) PyException_SetTraceback(exc, tb);
    int bad = finish_row(c, w, seq, parent, t0, NULL, exc) < 0;
    c->in_flight--;
    if (bad) capture_fail(c);
    PyErr_Restore(tp, exc, tb); /* the program's exception, unchanged */
    return NULL;
}

static void wrapped_dealloc(Wrapped *w) {
    PyObject_GC_UnTrack(w);
    Py_XDECREF(w->cap);
    Py_XDECREF(w->fn);
    Py_XDECREF(w->pids);
    Py_XDECREF(w->name);
    PyObject_GC_Del(w);
}

static int wrapped_traverse(Wrapped *w, visitproc visit, void *arg) {
    Py_VISIT(w->cap);
    Py_VISIT(w->fn);
    return 0;
}

static PyObject *wrapped_get_wrapped(Wrapped *w, void *closure) { return Py_NewRef(w->fn); }

static PyObject *wrapped_get_name(Wrapped *w, void *closure) { return Py_NewRef(w->name); }

static PyGetSetDef wrapped_getset[] = {
    {"__wrapped__", (getter)wrapped_get_wrapped, NULL, "the allocator method this records", NULL},
    {"__name__", (getter)wrapped_get_name, NULL, "the method's name", NULL},
    {NULL},
};

static PyTypeObject WrappedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvreplay.recorder._capture.Wrapped",
    .tp_basicsize = sizeof(Wrapped),
    .tp_dealloc = (destructor)wrapped_dealloc,
    .tp_vectorcall_offset = offsetof(Wrapped, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_traverse = (traverseproc)wrapped_traverse,
    .tp_getset = wrapped_getset,
    .tp_doc = "A recorded allocator method (kvreplay native capture).",
};

/* ---- Capture ---------------------------------------------------------------- */

static int values_init(Values *v) {
    memset(v, 0, sizeof(*v));
    v->objs = PyList_New(0);
    return v->objs ? 0 : -1;
}

static void values_free(Values *v) {
    PyMem_Free(v->head.p);
    PyMem_Free(v->shape.p);
    PyMem_Free(v->data.p);
    Py_CLEAR(v->objs);
}

/* The shim reports dtypes as scalar type codes: map each to this capture's dtype id
 * and element code (its dtypes dict is keyed by torch.dtype). A dtype the shim has no
 * code for stays unmapped (its tensors take the Python encoder); -1, with no Python
 * error left set, when the table cannot be trusted at all. */
static int fill_codes(Capture *c) {
    for (int k = 0; k < MAX_SCALAR_CODE; k++) c->code_dtype[k] = -1;
    PyObject *dt, *entry;
    Py_ssize_t pos = 0;
    int bad = 0;
    while (!bad && PyDict_Next(c->dtypes, &pos, &dt, &entry)) {
        PyObject *code = PyDict_GetItemWithError(shim.codes, dt);
        if (!code) {
            bad = PyErr_Occurred() != NULL;
            continue;
        }
        long k = PyLong_AsLong(code);
        if (k < 0 || k >= MAX_SCALAR_CODE) {
            bad = 1;
            continue;
        }
        c->code_dtype[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0));
        c->code_elem[k] = (int)PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));
        bad = PyErr_Occurred() != NULL;
    }
    if (bad) PyErr_Clear();
    return bad ? -1 : 0;
}

static int capture_init(Capture *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dtypes", "cpu_id", "name_ids", "name_id", "slow_put", "counters", "flush",
                             "flush_rows", "fail", "flush_ns", "raised", "counters_every", "fold_reads", NULL};
    PyObject *dtypes, *name_ids, *name_id, *slow_put, *counters, *flush, *fail, *raised = Py_None;
    long long cpu_id, flush_ns = 0;
    Py_ssize_t flush_rows, counters_every = 1;
    int fold_reads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!LO!OOOOnO|LOnp", kwlist, &PyDict_Type, &dtypes, &cpu_id,
                                     &PyDict_Type, &name_ids, &name_id, &slow_put, &counters, &flush, &flush_rows,
                                     &fail, &flush_ns, &raised, &counters_every, &fold_reads))
        return -1;
    if (counters != Py_None && (!PyTuple_Check(counters) || PyTuple_GET_SIZE(counters) != 3)) {
        PyErr_SetString(PyExc_TypeError, "counters must be a 3-tuple or None");
        return -1;
    }
    if (values_init(&c->args) < 0 || values_init(&c->result) < 0) return -1;
    c->excs = PyList_New(0);
    if (!c->excs) return -1;
    c->dtypes = Py_NewRef(dtypes);
    c->name_ids = Py_NewRef(name_ids);
    c->name_id = Py_NewRef(name_id);
    c->slow_put = Py_NewRef(slow_put);
    c->counters = Py_NewRef(counters);
    c->counters_every = counters_every;
    c->counter_tick = 0;
    c->flush = Py_NewRef(flush);
    c->fail = Py_NewRef(fail);
    c->raised = Py_NewRef(raised);
    c->cpu_id = cpu_id;
    c->use_shim = shim.on && fill_codes(c) == 0;
    c->flush_rows = flush_rows;
    c->flush_ns = flush_ns;
    c->active = 1;
    c->anchor = -1;
    c->group_anchor = -1;
    c->group_valid = 0;
    c->group_mid = -1;
    c->fold_reads = fold_reads;
    return 0;
}

static int capture_clear(Capture *c) {
    Py_CLEAR(c->args.objs);
    Py_CLEAR(c->result.objs);
    Py_CLEAR(c->excs);
    Py_CLEAR(c->dtypes);
    Py_CLEAR(c->name_ids);
    Py_CLEAR(c->name_id);
    Py_CLEAR(c->slow_put);
    Py_CLEAR(c->counters);
    Py_CLEAR(c->flush);
    Py_CLEAR(c->fail);
    Py_CLEAR(c->raised);
    return 0;
}

static int capture_traverse(Capture *c, visitproc visit, void *arg) {
    Py_VISIT(c->args.objs);
    Py_VISIT(c->result.objs);
    Py_VISIT(c->excs);
    Py_VISIT(c->dtypes);
    Py_VISIT(c->name_ids);
    Py_VISIT(c->name_id);
    Py_VISIT(c->slow_put);
    Py_VISIT(c->counters);
    Py_VISIT(c->flush);
    Py_VISIT(c->fail);
    Py_VISIT(c->raised);
    return 0;
}

static void capture_dealloc(Capture *c) {
    PyObject_GC_UnTrack(c);
    capture_clear(c);
    values_free(&c->args);
    values_free(&c->result);
    PyMem_Free(c->rows.p);
    PyMem_Free(c->arg_count.p);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *capture_wrap(Capture *c, PyObject *args) {
    PyObject *fn, *pids, *name;
    long long target, method;
    int finish, slot = -1;
    if (!PyArg_ParseTuple(args, "OLLO!iU|i", &fn, &target, &method, &PyTuple_Type, &pids, &finish, &name, &slot))
        return NULL;
    if (slot < -1 || slot > 2) {
        PyErr_SetString(PyExc_ValueError, "slot must be -1 or a counter 0..2");
        return NULL;
    }
    Wrapped *w = PyObject_GC_New(Wrapped, &WrappedType);
    if (!w) return NULL;
    w->cap = (Capture *)Py_NewRef(c);
    w->fn = Py_NewRef(fn);
    w->pids = Py_NewRef(pids);
    w->name = Py_NewRef(name);
    w->target = target;
    w->method = method;
    w->finish = finish;
    w->slot = slot;
    w->vectorcall = wrapped_vectorcall;
    PyObject_GC_Track(w);
    return (PyObject *)w;
}

static PyObject *values_take(Values *v) {
    PyObject *objs = PyList_GetSlice(v->objs, 0, PY_SSIZE_T_MAX);
    if (!objs) return NULL;
    PyList_SetSlice(v->objs, 0, PY_SSIZE_T_MAX, NULL);
    return Py_BuildValue("(NNNN)", buf_bytes(&v->head), buf_bytes(&v->shape), buf_bytes(&v->data), objs);
}

/* Everything captured since the last take, as bytes; the buffers start empty again. */
static PyObject *capture_take(Capture *c, PyObject *unused) {
    PyObject *excs = PyList_GetSlice(c->excs, 0, PY_SSIZE_T_MAX);
    if (!excs) return NULL;
    PyList_SetSlice(c->excs, 0, PY_SSIZE_T_MAX, NULL);
    /* A batch stands alone (a part of a rotated trace, a replay from a checkpoint):
     * nothing after it folds into its rows or leans on what they told. */
    c->anchor = -1;
    forget_group(c);
    c->cur_ok[0] = c->cur_ok[1] = c->cur_ok[2] = 0;
    return Py_BuildValue("(NNNNN)", buf_bytes(&c->rows), buf_bytes(&c->arg_count), values_take(&c->args),
                         values_take(&c->result), excs);
}

/* take(), but only between top-level calls (None inside one, or when nothing is
 * pending): another thread can flush without splitting a call's rows. */
static PyObject *capture_take_if_idle(Capture *c, PyObject *args) {
    long long quiet_ns = 0, max_age_ns = 0;
    if (!PyArg_ParseTuple(args, "|LL", &quiet_ns, &max_age_ns)) return NULL;
    if (c->depth || c->in_flight || c->rows.len == 0) Py_RETURN_NONE;
    int64_t now = now_ns();
    if (now - c->last_t1 < quiet_ns && !(max_age_ns > 0 && now - c->batch_t0 >= max_age_ns)) Py_RETURN_NONE;
    return capture_take(c, NULL);
}

static PyObject *capture_reset_py(Capture *c, PyObject *unused) {
    capture_reset(c);
    Py_RETURN_NONE;
}

static PyObject *capture_pending_rows(Capture *c, void *closure) { return PyLong_FromSsize_t(c->rows.len / ROW_WIDTH); }
static PyObject *capture_get_next_seq(Capture *c, void *closure) { return PyLong_FromLongLong(c->next_seq); }
static PyObject *capture_get_active(Capture *c, void *closure) { return PyBool_FromLong(c->active); }
static PyObject *capture_get_depth(Capture *c, void *closure) { return PyLong_FromLong(c->depth); }
static PyObject *capture_get_in_group(Capture *c, void *closure) { return PyBool_FromLong(c->in_group); }

static int capture_set_active(Capture *c, PyObject *v, void *closure) {
    int t = v ? PyObject_IsTrue(v) : 0;
    if (t < 0) return -1;
    c->active = t;
    return 0;
}

static PyMethodDef capture_methods[] = {
    {"wrap", (PyCFunction)capture_wrap, METH_VARARGS,
     "wrap(fn, target_id, method_id, param_ids, finish, name[, slot]) -> a recording callable"},
    {"take", (PyCFunction)capture_take, METH_NOARGS, "take() -> captured buffers as bytes, emptied"},
    {"take_if_idle", (PyCFunction)capture_take_if_idle, METH_VARARGS,
     "take_if_idle(quiet_ns=0, max_age_ns=0): take() between top-level calls with rows pending, the newest top-level row quiet_ns old (or the oldest max_age_ns), else None (atomic under the GIL)"},
    {"reset", (PyCFunction)capture_reset_py, METH_NOARGS, "drop everything captured so far"},
    {NULL},
};

static PyGetSetDef capture_getset[] = {
    {"next_seq", (getter)capture_get_next_seq, NULL, "sequence number of the next call", NULL},
    {"pending_rows", (getter)capture_pending_rows, NULL, "rows captured and not yet taken", NULL},
    {"active", (getter)capture_get_active, (setter)capture_set_active, "whether calls are recorded", NULL},
    {"depth", (getter)capture_get_depth, NULL, "calls in progress", NULL},
    {"in_group", (getter)capture_get_in_group, NULL, "inside a free group (top level)", NULL},
    {NULL},
};

static PyTypeObject CaptureType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvreplay.recorder._capture.Capture",
    .tp_basicsize = sizeof(Capture),
    .tp_dealloc = (destructor)capture_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)capture_traverse,
    .tp_clear = (inquiry)capture_clear,
    .tp_methods = capture_methods,
    .tp_getset = capture_getset,
    .tp_init = (initproc)capture_init,
    .tp_new = PyType_GenericNew,
    .tp_doc = "Native call capture state of one recording.",
};

static PyObject *set_tensor_type(PyObject *mod, PyObject *tp) {
    if (!PyType_Check(tp)) {
        PyErr_SetString(PyExc_TypeError, "expected torch.Tensor");
        return NULL;
    }
    Py_XSETREF(TensorType, (PyTypeObject *)Py_NewRef(tp));
    Py_RETURN_NONE;
}

/* set_tensor_shim(offset, (dtype, device_type, is_contiguous, dim, numel, data_ptr, sizes),
 *                 codes, cpu_type): function addresses as ints; offset 0 switches it off.
 * Captures built afterwards use it. */
static PyObject *set_tensor_shim(PyObject *mod, PyObject *args) {
    Py_ssize_t offset;
    PyObject *fns, *codes;
    int cpu_type;
    if (!PyArg_ParseTuple(args, "nO!O!i", &offset, &PyTuple_Type, &fns, &PyDict_Type, &codes, &cpu_type)) return NULL;
    if (offset <= 0) {
        shim.on = 0;
        Py_RETURN_NONE;
    }
    if (PyTuple_GET_SIZE(fns) != 7 || !TensorType || offset + (Py_ssize_t)sizeof(void *) > TensorType->tp_basicsize) {
        PyErr_SetString(PyExc_ValueError, "set_tensor_shim: 7 functions and an offset inside torch.Tensor");
        return NULL;
    }
    void *f[7];
    for (int k = 0; k < 7; k++) {
        f[k] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fns, k));
        if (!f[k]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "set_tensor_shim: null function");
            return NULL;
        }
    }
    shim.dtype = (shim_i32_fn)f[0];
    shim.device_type = (shim_i32_fn)f[1];
    shim.is_contiguous = (shim_bool_fn)f[2];
    shim.dim = (shim_i64_fn)f[3];
    shim.numel = (shim_i64_fn)f[4];
    shim.data_ptr = (shim_ptr_fn)f[5];
    shim.sizes = (shim_sizes_fn)f[6];
    shim.offset = offset;
    shim.cpu_type = cpu_type;
    Py_XSETREF(shim.codes, Py_NewRef(codes));
    shim.on = 1;
    Py_RETURN_NONE;
}

/* What the shim sees in one tensor, for capture.py's check before it trusts it:
 * (dtype code, device type, contiguous, dim, numel, data pointer, sizes) or None. */
static PyObject *shim_probe(PyObject *mod, PyObject *v) {
    if (!shim.on || !TensorType || !Py_IS_TYPE(v, TensorType)) Py_RETURN_NONE;
    void *h = (char *)v + shim.offset;
    int32_t code, dev;
    unsigned char contig;
    int64_t nd, n, *sizes;
    void *ptr = NULL;
    if (shim.dtype(h, &code) || shim.device_type(h, &dev) || shim.is_contiguous(h, &contig) || shim.dim(h, &nd)
        || shim.numel(h, &n) || shim.data_ptr(h, &ptr) || shim.sizes(h, &sizes)) Py_RETURN_NONE;
    PyObject *shape = PyTuple_New(nd);
    if (!shape) return NULL;
    for (int64_t k = 0; k < nd; k++) PyTuple_SET_ITEM(shape, k, PyLong_FromLongLong(sizes[k]));
    return Py_BuildValue("iiiLLKN", code, dev, (int)contig, (long long)nd, (long long)n,
                         (unsigned long long)(uintptr_t)ptr, shape);
}

static PyMethodDef module_methods[] = {
    {"set_tensor_type", set_tensor_type, METH_O, "tell the module which type is torch.Tensor"},
    {"set_tensor_shim", set_tensor_shim, METH_VARARGS, "read tensors through torch's C shim"},
    {"shim_probe", shim_probe, METH_O, "what the shim reads from one tensor"},
    {NULL},
};

static struct PyModuleDef capture_module = {
    PyModuleDef_HEAD_INIT, "_capture", "Native call capture for the kvreplay recorder.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__capture(void) {
    if (PyType_Ready(&WrappedType) < 0 || PyType_Ready(&CaptureType) < 0) return NULL;
    s_dtype = PyUnicode_InternFromString("dtype");
    s_is_cpu = PyUnicode_InternFromString("is_cpu");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_dim = PyUnicode_InternFromString("dim");
    s_numel = PyUnicode_InternFromString("numel");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_shape = PyUnicode_InternFromString("shape");
    s_name = PyUnicode_InternFromString("__name__");
    PyObject *m = PyModule_Create(&capture_module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Capture", (PyObject *)&CaptureType) < 0) return NULL;
    /* What it was built with, so capture.py can refuse a module built from another layout. */
    PyObject *layout = Py_BuildValue("{sisisisisisisisisisisisisisisisisisisisisisisisisisi}",
        "VALUE_WIDTH", VALUE_WIDTH, "ROW_WIDTH", ROW_WIDTH, "ROW_FOLD_PATTERN", ROW_FOLD_PATTERN,
        "ROW_FOLD_COUNT", ROW_FOLD_COUNT, "FOLD_MAX", FOLD_MAX, "ROW_GROUP_AT", ROW_GROUP_AT,
        "ROW_GROUP_TARGETS", ROW_GROUP_TARGETS, "ROW_BOUNDS", ROW_BOUNDS, "ROW_BOUNDS_TARGETS", ROW_BOUNDS_TARGETS,
        "GROUP_OPENED", GROUP_OPENED, "GROUP_CLOSED", GROUP_CLOSED, "GROUP_NESTED_MAX", GROUP_NESTED_MAX,
        "GROUP_TARGET_BITS", GROUP_TARGET_BITS, "K_NONE", K_NONE, "K_BOOL", K_BOOL, "K_INT", K_INT,
        "K_FLOAT", K_FLOAT, "K_STR", K_STR, "K_TENSOR", K_TENSOR, "K_INTS", K_INTS, "K_SEGMENTS", K_SEGMENTS,
        "K_OPAQUE", K_OPAQUE, "FINISH_CALL", FINISH_CALL, "FINISH_READ", FINISH_READ,
        "FINISH_GROUP_BEGIN", FINISH_GROUP_BEGIN, "FINISH_GROUP_END", FINISH_GROUP_END);
    if (!layout || PyModule_AddObject(m, "LAYOUT", layout) < 0) { Py_XDECREF(layout); return NULL; }
    return m;
}
