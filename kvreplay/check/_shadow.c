/* Index kernels for the invariant checker's shadow model.
 *
 * Replay calls hand the checker a few dozen slots at a time; with numpy each step
 * (range check, live lookup, page division, distinct pages) costs a microsecond or
 * more of call overhead whatever the size, and the checker made replay 1.5x slower
 * than the build's own calls. These loops do the same work in one pass. Semantics
 * match the numpy code in invariants.py, which remains the fallback and is checked
 * against these by the tests.
 *
 * Arrays arrive through the buffer protocol: int64 index arrays (numpy), bool/uint8
 * state arrays (numpy, written in place). Index inputs may also be Python lists. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    PyObject *seq; /* when the input was a list or tuple */
    const int64_t *p;
    Py_ssize_t n;
    int64_t *owned; /* converted list elements */
} Ints;

static void ints_release(Ints *a) {
    if (a->seq) {
        Py_DECREF(a->seq);
        PyMem_Free(a->owned);
    } else if (a->view.obj) {
        PyBuffer_Release(&a->view);
    }
}

/* An int64 array or a list/tuple of ints. */
static int ints_get(PyObject *obj, Ints *a) {
    memset(a, 0, sizeof(*a));
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        a->seq = PySequence_Fast(obj, "expected a sequence of ints");
        if (!a->seq) return -1;
        a->n = PySequence_Fast_GET_SIZE(a->seq);
        a->owned = PyMem_Malloc((size_t)(a->n ? a->n : 1) * sizeof(int64_t));
        if (!a->owned) { Py_CLEAR(a->seq); PyErr_NoMemory(); return -1; }
        for (Py_ssize_t i = 0; i < a->n; i++) {
            a->owned[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(a->seq, i));
        }
        if (PyErr_Occurred()) { ints_release(a); return -1; }
        a->p = a->owned;
        return 0;
    }
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (a->view.itemsize != 8 || !a->view.format || (strcmp(a->view.format, "q") && strcmp(a->view.format, "l"))) {
        PyBuffer_Release(&a->view);
        a->view.obj = NULL;
        PyErr_SetString(PyExc_TypeError, "expected an int64 array");
        return -1;
    }
    a->p = (const int64_t *)a->view.buf;
    a->n = a->view.len / 8;
    return 0;
}

/* A writable bool/uint8 array. */
static int bools_get(PyObject *obj, Py_buffer *v) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    if (v->itemsize != 1) {
        PyBuffer_Release(v);
        PyErr_SetString(PyExc_TypeError, "expected a bool array");
        return -1;
    }
    return 0;
}

static int64_t floordiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

static int append_int(PyObject **list, int64_t v) {
    if (!*list && !(*list = PyList_New(0))) return -1;
    PyObject *x = PyLong_FromLongLong(v);
    if (!x) return -1;
    int rc = PyList_Append(*list, x);
    Py_DECREF(x);
    return rc;
}

static PyObject *list_or_empty(PyObject *list) { return list ? list : PyList_New(0); }

/* handout(live, owned, tokens, ps) -> (bad, again, fresh_pages)
 * bad: tokens outside ps .. len(live)-1; again: in-range tokens already live before
 * the call; then every in-range token is marked live and its page owned; fresh_pages
 * counts pages that were not owned. */
static PyObject *handout(PyObject *self, PyObject *args) {
    PyObject *live_o, *owned_o, *tok_o;
    long long ps;
    if (!PyArg_ParseTuple(args, "OOOL", &live_o, &owned_o, &tok_o, &ps)) return NULL;
    Py_buffer live, owned;
    Ints tok;
    if (bools_get(live_o, &live) < 0) return NULL;
    if (bools_get(owned_o, &owned) < 0) { PyBuffer_Release(&live); return NULL; }
    if (ints_get(tok_o, &tok) < 0) { PyBuffer_Release(&live); PyBuffer_Release(&owned); return NULL; }
    uint8_t *lv = live.buf, *ow = owned.buf;
    int64_t nlive = live.len, nowned = owned.len;
    PyObject *bad = NULL, *again = NULL, *out = NULL;
    int64_t fresh = 0;
    for (Py_ssize_t i = 0; i < tok.n; i++) {
        int64_t t = tok.p[i];
        if (t < ps || t >= nlive) {
            if (append_int(&bad, t) < 0) goto done;
        } else if (lv[t] && append_int(&again, t) < 0) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < tok.n; i++) {
        int64_t t = tok.p[i];
        if (t < ps || t >= nlive) continue;
        lv[t] = 1;
        int64_t page = t / ps;
        if (page < nowned && !ow[page]) {
            ow[page] = 1;
            fresh++;
        }
    }
    out = Py_BuildValue("(NNL)", list_or_empty(bad), list_or_empty(again), (long long)fresh);
    bad = again = NULL;
done:
    Py_XDECREF(bad);
    Py_XDECREF(again);
    ints_release(&tok);
    PyBuffer_Release(&live);
    PyBuffer_Release(&owned);
    return out;
}

/* release(owned, live, pages, ps) -> (not_held, released)
 * For each page (distinct): held pages (1..len(owned)-1 and owned) are released and
 * their slots made not live; the others are returned. */
static PyObject *release(PyObject *self, PyObject *args) {
    PyObject *owned_o, *live_o, *pages_o;
    long long ps;
    if (!PyArg_ParseTuple(args, "OOOL", &owned_o, &live_o, &pages_o, &ps)) return NULL;
    Py_buffer owned, live;
    Ints pages;
    if (bools_get(owned_o, &owned) < 0) return NULL;
    if (bools_get(live_o, &live) < 0) { PyBuffer_Release(&owned); return NULL; }
    if (ints_get(pages_o, &pages) < 0) { PyBuffer_Release(&owned); PyBuffer_Release(&live); return NULL; }
    uint8_t *ow = owned.buf, *lv = live.buf;
    int64_t n = owned.len - 1;
    PyObject *bad = NULL, *out = NULL;
    int64_t released = 0;
    for (Py_ssize_t i = 0; i < pages.n; i++) {
        int64_t p = pages.p[i];
        if (p >= 1 && p <= n && ow[p]) {
            ow[p] = 0;
            if ((p + 1) * ps <= live.len) memset(lv + p * ps, 0, (size_t)ps);
            released++;
        } else if (append_int(&bad, p) < 0) {
            goto done;
        }
    }
    out = Py_BuildValue("(NL)", list_or_empty(bad), (long long)released);
    bad = NULL;
done:
    Py_XDECREF(bad);
    ints_release(&pages);
    PyBuffer_Release(&owned);
    PyBuffer_Release(&live);
    return out;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* distinct_pages(tokens, ps) -> sorted list of distinct tokens // ps */
static PyObject *distinct_pages(PyObject *self, PyObject *args) {
    PyObject *tok_o;
    long long ps;
    if (!PyArg_ParseTuple(args, "OL", &tok_o, &ps)) return NULL;
    if (ps <= 0) { PyErr_SetString(PyExc_ValueError, "page size must be positive"); return NULL; }
    Ints tok;
    if (ints_get(tok_o, &tok) < 0) return NULL;
    int64_t stack[256];
    int64_t *pg = tok.n <= 256 ? stack : PyMem_Malloc((size_t)tok.n * sizeof(int64_t));
    PyObject *out = NULL;
    if (!pg) { PyErr_NoMemory(); goto done; }
    int sorted = 1;
    for (Py_ssize_t i = 0; i < tok.n; i++) {
        pg[i] = floordiv(tok.p[i], ps);
        if (i && pg[i] < pg[i - 1]) sorted = 0;
    }
    if (!sorted) qsort(pg, (size_t)tok.n, sizeof(int64_t), cmp_i64);
    out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < tok.n; i++) {
        if (i && pg[i] == pg[i - 1]) continue;
        PyObject *x = PyLong_FromLongLong(pg[i]);
        if (!x || PyList_Append(out, x) < 0) { Py_XDECREF(x); Py_CLEAR(out); break; }
        Py_DECREF(x);
    }
    if (pg != stack) PyMem_Free(pg);
done:
    ints_release(&tok);
    return out;
}

/* page_peers(mapping, pages, ps, any_only) -> list of the nonzero mapping entries of
 * the pages' slots (slots outside the mapping have none), or with any_only a bool. */
static PyObject *page_peers(PyObject *self, PyObject *args) {
    PyObject *map_o, *pages_o;
    long long ps;
    int any_only;
    if (!PyArg_ParseTuple(args, "OOLp", &map_o, &pages_o, &ps, &any_only)) return NULL;
    Ints map, pages;
    if (ints_get(map_o, &map) < 0) return NULL;
    if (ints_get(pages_o, &pages) < 0) { ints_release(&map); return NULL; }
    PyObject *out = any_only ? NULL : PyList_New(0);
    int found = 0;
    for (Py_ssize_t i = 0; i < pages.n && !found && (any_only || out); i++) {
        if (ps <= 0 || pages.p[i] < 0 || pages.p[i] > map.n / ps) continue; /* a wild page: no slot of it is mapped */
        int64_t base = pages.p[i] * ps;
        for (int64_t o = 0; o < ps; o++) {
            int64_t s = base + o;
            if (s < 0 || s >= map.n || map.p[s] <= 0) continue;
            if (any_only) { found = 1; break; }
            PyObject *x = PyLong_FromLongLong(map.p[s]);
            if (!x || PyList_Append(out, x) < 0) { Py_XDECREF(x); Py_CLEAR(out); break; }
            Py_DECREF(x);
        }
    }
    ints_release(&map);
    ints_release(&pages);
    if (any_only) return PyErr_Occurred() ? NULL : PyBool_FromLong(found);
    return out;
}

/* swa_alloc(mapping, swa_owner, full_live, swa_live, swa_owned, mapped, swa_ps)
 *   -> (no_peer, shared, bad, again, fresh_pages)
 * The SWA half of an allocation, as InvariantChecker._after_alloc does it in numpy:
 * full slots whose peer is not positive (no_peer) are dropped; a peer inside the SWA
 * pool whose recorded owner is another live full slot that still maps to it is
 * shared (slot, that owner, the new full slot); then the peers are handed out in the
 * SWA shadow (bad: outside the pool, again: already live) and the in-range ones get
 * their new owner. */
static PyObject *swa_alloc(PyObject *self, PyObject *args) {
    PyObject *map_o, *owner_o, *flive_o, *slive_o, *sowned_o, *mapped_o;
    long long ps;
    if (!PyArg_ParseTuple(args, "OOOOOOL", &map_o, &owner_o, &flive_o, &slive_o, &sowned_o, &mapped_o, &ps))
        return NULL;
    Ints map, mapped;
    Py_buffer owner, flive, slive, sowned;
    int got = 0;
    if (ints_get(map_o, &map) < 0) return NULL;
    got = 1;
    if (PyObject_GetBuffer(owner_o, &owner, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) goto fail;
    got = 2;
    if (owner.itemsize != 8 || (strcmp(owner.format, "q") && strcmp(owner.format, "l"))) {
        PyErr_SetString(PyExc_TypeError, "expected an int64 owner array");
        goto fail;
    }
    if (bools_get(flive_o, &flive) < 0) goto fail;
    got = 3;
    if (bools_get(slive_o, &slive) < 0) goto fail;
    got = 4;
    if (bools_get(sowned_o, &sowned) < 0) goto fail;
    got = 5;
    if (ints_get(mapped_o, &mapped) < 0) goto fail;
    got = 6;

    int64_t *own = owner.buf, n_own = owner.len / 8;
    uint8_t *fl = flive.buf, *sl = slive.buf, *so = sowned.buf;
    int64_t nslive = slive.len;
    PyObject *no_peer = NULL, *shared = NULL, *bad = NULL, *again = NULL, *out = NULL;
    int64_t fresh = 0;
    for (Py_ssize_t i = 0; i < mapped.n; i++) {
        int64_t f = mapped.p[i];
        int64_t q = (f >= 0 && f < map.n) ? map.p[f] : 0;
        if (q <= 0) {
            if (append_int(&no_peer, f) < 0) goto done;
            continue;
        }
        if (q >= ps && q < nslive && q < n_own) {
            int64_t prev = own[q];
            if (prev != f && prev >= 0 && prev < flive.len && fl[prev] && prev < map.n && map.p[prev] == q) {
                PyObject *t = Py_BuildValue("(LLL)", (long long)q, (long long)prev, (long long)f);
                if (!t) goto done;
                if (!shared && !(shared = PyList_New(0))) { Py_DECREF(t); goto done; }
                int rc = PyList_Append(shared, t);
                Py_DECREF(t);
                if (rc < 0) goto done;
            }
        }
        if (q < ps || q >= nslive) {
            if (append_int(&bad, q) < 0) goto done;
        } else if (sl[q] && append_int(&again, q) < 0) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < mapped.n; i++) {
        int64_t f = mapped.p[i];
        int64_t q = (f >= 0 && f < map.n) ? map.p[f] : 0;
        if (q < ps || q >= nslive) continue;
        sl[q] = 1;
        int64_t page = q / ps;
        if (page < sowned.len && !so[page]) {
            so[page] = 1;
            fresh++;
        }
        if (q < n_own) own[q] = f;
    }
    out = Py_BuildValue("(NNNNL)", list_or_empty(no_peer), list_or_empty(shared), list_or_empty(bad),
                        list_or_empty(again), (long long)fresh);
    no_peer = shared = bad = again = NULL;
done:
    Py_XDECREF(no_peer);
    Py_XDECREF(shared);
    Py_XDECREF(bad);
    Py_XDECREF(again);
    ints_release(&mapped);
    PyBuffer_Release(&sowned);
    PyBuffer_Release(&slive);
    PyBuffer_Release(&flive);
    PyBuffer_Release(&owner);
    ints_release(&map);
    return out;
fail:
    if (got >= 5) PyBuffer_Release(&sowned);
    if (got >= 4) PyBuffer_Release(&slive);
    if (got >= 3) PyBuffer_Release(&flive);
    if (got >= 2) PyBuffer_Release(&owner);
    ints_release(&map);
    return NULL;
}

/* any_mapped(mapping, tokens) -> whether any of the slots has a nonzero mapping */
static PyObject *any_mapped(PyObject *self, PyObject *args) {
    PyObject *map_o, *tok_o;
    if (!PyArg_ParseTuple(args, "OO", &map_o, &tok_o)) return NULL;
    Ints map, tok;
    if (ints_get(map_o, &map) < 0) return NULL;
    if (ints_get(tok_o, &tok) < 0) { ints_release(&map); return NULL; }
    int found = 0;
    for (Py_ssize_t i = 0; i < tok.n && !found; i++) {
        int64_t t = tok.p[i];
        found = t >= 0 && t < map.n && map.p[t] != 0;
    }
    ints_release(&map);
    ints_release(&tok);
    return PyBool_FromLong(found);
}

static PyMethodDef methods[] = {
    {"handout", handout, METH_VARARGS, "handout(live, owned, tokens, ps) -> (bad, again, fresh_pages)"},
    {"release", release, METH_VARARGS, "release(owned, live, pages, ps) -> (not_held, released)"},
    {"distinct_pages", distinct_pages, METH_VARARGS, "distinct_pages(tokens, ps) -> sorted distinct pages"},
    {"page_peers", page_peers, METH_VARARGS, "page_peers(mapping, pages, ps, any_only) -> peers or bool"},
    {"swa_alloc", swa_alloc, METH_VARARGS,
     "swa_alloc(mapping, swa_owner, full_live, swa_live, swa_owned, mapped, swa_ps) -> (no_peer, shared, bad, again, fresh)"},
    {"any_mapped", any_mapped, METH_VARARGS, "any_mapped(mapping, tokens) -> bool"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shadow", "Index kernels for the invariant checker.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__shadow(void) { return PyModule_Create(&module); }
