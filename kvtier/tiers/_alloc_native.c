/* ExtentAllocator in C: kvtier/tiers/allocator.py's best-fit allocator, the same extents
 * for the same calls (tests/tiers/test_allocator_native.py replays random call sequences
 * against the Python one).
 *
 * Why: a streamed put allocates one extent and a demotion frees it, and in Python that
 * is ~7 us of the daemon loop's ~110-150 a 64 KiB block (two sorted containers, each a
 * list of lists with its own index). Here it is a few hundred nanoseconds, most of it
 * making the Extent the caller gets.
 *
 * The free extents are kept three ways: by (size, offset) in a sorted list of sorted
 * chunks (best fit: the first pair at or above (need, 0); a chunk is split when full, so
 * an insert moves at most a chunk's pairs), and in two hash tables, start -> size and
 * end -> start, which find the neighbours a free merges with. The Python allocator finds
 * the one before by bisecting its offsets; the free extent that ends where a freed one
 * starts is that one, since free extents never overlap.
 */
#define PY_SSIZE_T_CLEAN
/* the stable ABI of 3.11, as kvtier/index/_arc_native.c */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../_native_u64map.h" /* U64Map */

/* ---- the free extents by (size, offset) -------------------------------------------------- */

typedef struct {
    uint64_t size, off;
} Pair;

static inline int pair_lt(Pair a, Pair b)
{
    return a.size < b.size || (a.size == b.size && a.off < b.off);
}

#define CHUNK_MAX 256 /* pairs a chunk holds; a full one is split in two before an insert */

typedef struct {
    Pair *items;
    Py_ssize_t n;
} Chunk;

typedef struct {
    Chunk *chunks;
    Py_ssize_t nchunks, cap;
} SizeSet;

/* the first chunk whose last pair is not below `key` (nchunks: none) */
static Py_ssize_t chunk_for(const SizeSet *s, Pair key)
{
    Py_ssize_t lo = 0, hi = s->nchunks;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        const Chunk *c = &s->chunks[mid];
        if (pair_lt(c->items[c->n - 1], key))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* the first index in `c` whose pair is not below `key` */
static Py_ssize_t lower_in(const Chunk *c, Pair key)
{
    Py_ssize_t lo = 0, hi = c->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (pair_lt(c->items[mid], key))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* room for a new chunk at `at` (its items allocated, n = 0) */
static int chunk_insert(SizeSet *s, Py_ssize_t at)
{
    if (s->nchunks == s->cap) {
        Py_ssize_t cap = s->cap ? 2 * s->cap : 8;
        Chunk *grown = PyMem_Realloc(s->chunks, (size_t)cap * sizeof(Chunk));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->chunks = grown;
        s->cap = cap;
    }
    Pair *items = PyMem_Malloc(CHUNK_MAX * sizeof(Pair));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memmove(&s->chunks[at + 1], &s->chunks[at], (size_t)(s->nchunks - at) * sizeof(Chunk));
    s->chunks[at].items = items;
    s->chunks[at].n = 0;
    s->nchunks++;
    return 0;
}

static int sset_insert(SizeSet *s, Pair key)
{
    if (s->nchunks == 0) { /* chunks are never empty but while this one is made */
        if (chunk_insert(s, 0) < 0)
            return -1;
        s->chunks[0].items[0] = key;
        s->chunks[0].n = 1;
        return 0;
    }
    Py_ssize_t ci = chunk_for(s, key);
    if (ci == s->nchunks)
        ci--; /* above every pair: at the end of the last chunk */
    if (s->chunks[ci].n == CHUNK_MAX) { /* full: its upper half into a new chunk after it */
        if (chunk_insert(s, ci + 1) < 0)
            return -1; /* nothing changed */
        Chunk *c = &s->chunks[ci], *upper = &s->chunks[ci + 1];
        Py_ssize_t half = CHUNK_MAX / 2;
        memcpy(upper->items, &c->items[half], (size_t)(c->n - half) * sizeof(Pair));
        upper->n = c->n - half;
        c->n = half;
        if (!pair_lt(key, upper->items[0]))
            ci++;
    }
    Chunk *c = &s->chunks[ci];
    Py_ssize_t i = lower_in(c, key);
    memmove(&c->items[i + 1], &c->items[i], (size_t)(c->n - i) * sizeof(Pair));
    c->items[i] = key;
    c->n++;
    return 0;
}

static void sset_erase_at(SizeSet *s, Py_ssize_t ci, Py_ssize_t i)
{
    Chunk *c = &s->chunks[ci];
    memmove(&c->items[i], &c->items[i + 1], (size_t)(c->n - i - 1) * sizeof(Pair));
    c->n--;
    if (c->n == 0) {
        PyMem_Free(c->items);
        memmove(&s->chunks[ci], &s->chunks[ci + 1], (size_t)(s->nchunks - ci - 1) * sizeof(Chunk));
        s->nchunks--;
    }
}

/* remove `key`, which is in the set */
static void sset_erase(SizeSet *s, Pair key)
{
    Py_ssize_t ci = chunk_for(s, key);
    sset_erase_at(s, ci, lower_in(&s->chunks[ci], key));
}

static void sset_free(SizeSet *s)
{
    for (Py_ssize_t i = 0; i < s->nchunks; i++)
        PyMem_Free(s->chunks[i].items);
    PyMem_Free(s->chunks);
    s->chunks = NULL;
    s->nchunks = s->cap = 0;
}

/* ---- the allocator ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    SizeSet by_size;
    U64Map starts; /* free extent's offset -> its size */
    U64Map ends;   /* free extent's end -> its offset */
    uint64_t capacity, alignment, used;
    PyObject *extent_type; /* kvtier.types.Extent */
    int ready;
} Alloc;

static int add_free(Alloc *a, uint64_t off, uint64_t size)
{
    Pair p = {size, off};
    if (sset_insert(&a->by_size, p) < 0 || map_put(&a->starts, off, size) < 0 ||
        map_put(&a->ends, off + size, off) < 0)
        return -1;
    return 0;
}

/* remove the free extent starting at `off` (it exists); its size */
static uint64_t remove_free(Alloc *a, uint64_t off)
{
    uint64_t size = 0;
    map_get(&a->starts, off, &size);
    map_del(&a->starts, off);
    map_del(&a->ends, off + size);
    Pair p = {size, off};
    sset_erase(&a->by_size, p);
    return size;
}

static PyObject *make_extent(Alloc *a, uint64_t off, uint64_t size)
{
    return PyObject_CallFunction(a->extent_type, "KK", (unsigned long long)off,
                                 (unsigned long long)size);
}

#define REQUIRE_READY(a, err)                                                                  \
    do {                                                                                       \
        if (!(a)->ready) {                                                                     \
            PyErr_SetString(PyExc_RuntimeError, "ExtentAllocator.__init__ was not called");    \
            return err;                                                                        \
        }                                                                                      \
    } while (0)

static PyObject *Alloc_allocate(Alloc *a, PyObject *arg)
{
    REQUIRE_READY(a, NULL);
    int overflow;
    long long asked = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (asked == -1 && PyErr_Occurred())
        return NULL;
    if (overflow > 0 || (asked > 0 && (uint64_t)asked > a->capacity))
        Py_RETURN_NONE; /* more than the arena: no extent holds it */
    uint64_t want = asked < 1 ? 1 : (uint64_t)asked;
    uint64_t need = (want + a->alignment - 1) / a->alignment * a->alignment;
    Pair key = {need, 0};
    Py_ssize_t ci = chunk_for(&a->by_size, key);
    if (ci == a->by_size.nchunks)
        Py_RETURN_NONE;
    Chunk *c = &a->by_size.chunks[ci];
    Py_ssize_t i = lower_in(c, key);
    Pair got = c->items[i];
    PyObject *extent = make_extent(a, got.off, need);
    if (extent == NULL)
        return NULL; /* nothing changed */
    sset_erase_at(&a->by_size, ci, i);
    map_del(&a->starts, got.off);
    map_del(&a->ends, got.off + got.size);
    if (got.size > need && add_free(a, got.off + need, got.size - need) < 0) {
        Py_DECREF(extent);
        return NULL;
    }
    a->used += need;
    return extent;
}

static int extent_field(PyObject *extent, const char *name, uint64_t *out)
{
    PyObject *v = PyObject_GetAttrString(extent, name);
    if (v == NULL)
        return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "an extent's %s is never negative", name);
        return -1;
    }
    *out = (uint64_t)n;
    return 0;
}

static PyObject *Alloc_free(Alloc *a, PyObject *extent)
{
    REQUIRE_READY(a, NULL);
    uint64_t off, size, found;
    if (extent_field(extent, "offset", &off) < 0 || extent_field(extent, "size_bytes", &size) < 0)
        return NULL;
    if (map_get(&a->starts, off, &found)) {
        PyErr_Format(PyExc_ValueError, "double free of extent at %llu", (unsigned long long)off);
        return NULL;
    }
    if (size == 0 || off > a->capacity || size > a->capacity - off || size > a->used) {
        PyErr_Format(PyExc_ValueError,
                     "extent at %llu of %llu bytes was not allocated from this arena",
                     (unsigned long long)off, (unsigned long long)size);
        return NULL;
    }
    a->used -= size;
    if (map_get(&a->starts, off + size, &found))
        size += remove_free(a, off + size);
    uint64_t prev;
    if (map_get(&a->ends, off, &prev)) {
        size += remove_free(a, prev);
        off = prev;
    }
    if (add_free(a, off, size) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Alloc_largest_free_bytes(Alloc *a, PyObject *Py_UNUSED(ignored))
{
    REQUIRE_READY(a, NULL);
    const SizeSet *s = &a->by_size;
    if (s->nchunks == 0)
        return PyLong_FromLong(0);
    const Chunk *last = &s->chunks[s->nchunks - 1];
    return PyLong_FromUnsignedLongLong(last->items[last->n - 1].size);
}

static int by_offset(const void *x, const void *y)
{
    uint64_t a = ((const Pair *)x)->off, b = ((const Pair *)y)->off;
    return (a > b) - (a < b);
}

static PyObject *Alloc_free_extents(Alloc *a, PyObject *Py_UNUSED(ignored))
{
    REQUIRE_READY(a, NULL);
    size_t n = a->starts.len;
    Pair *all = PyMem_Malloc((n ? n : 1) * sizeof(Pair));
    if (all == NULL)
        return PyErr_NoMemory();
    size_t k = 0;
    for (size_t i = 0; i <= a->starts.mask; i++)
        if (a->starts.keys[i] != 0) {
            all[k].off = a->starts.keys[i] - 1;
            all[k].size = a->starts.vals[i];
            k++;
        }
    qsort(all, n, sizeof(Pair), by_offset);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *extent = make_extent(a, all[i].off, all[i].size);
        if (extent == NULL)
            Py_CLEAR(out);
        else
            PyList_SetItem(out, (Py_ssize_t)i, extent);
    }
    PyMem_Free(all);
    return out;
}

static int Alloc_init(Alloc *a, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity_bytes", "alignment_bytes", NULL};
    long long capacity, alignment = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|L", kwlist, &capacity, &alignment))
        return -1;
    if (a->ready) {
        PyErr_SetString(PyExc_RuntimeError, "ExtentAllocator is initialised once");
        return -1;
    }
    if (capacity <= 0 || alignment <= 0 || capacity % alignment) {
        PyErr_SetString(PyExc_ValueError, "capacity must be a positive multiple of the alignment");
        return -1;
    }
    PyObject *types = PyImport_ImportModule("kvtier.types");
    if (types == NULL)
        return -1;
    a->extent_type = PyObject_GetAttrString(types, "Extent");
    Py_DECREF(types);
    if (a->extent_type == NULL)
        return -1;
    a->capacity = (uint64_t)capacity;
    a->alignment = (uint64_t)alignment;
    a->used = 0;
    if (map_init(&a->starts, 64) < 0 || map_init(&a->ends, 64) < 0 || add_free(a, 0, a->capacity) < 0)
        return -1;
    a->ready = 1;
    return 0;
}

static void Alloc_dealloc(Alloc *a)
{
    Py_CLEAR(a->extent_type);
    sset_free(&a->by_size);
    map_free(&a->starts);
    map_free(&a->ends);
    PyTypeObject *type = Py_TYPE((PyObject *)a);
    freefunc free_fn = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_fn(a);
    Py_DECREF(type);
}

static PyObject *Alloc_get_used(Alloc *a, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(a->used);
}

static PyObject *Alloc_get_capacity(Alloc *a, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(a->capacity);
}

static PyObject *Alloc_get_alignment(Alloc *a, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(a->alignment);
}

static PyMethodDef Alloc_methods[] = {
    {"allocate", (PyCFunction)Alloc_allocate, METH_O,
     "allocate(size_bytes): the smallest free extent that holds it (rounded up), or None"},
    {"free", (PyCFunction)Alloc_free, METH_O,
     "free(extent): return an extent allocate gave, merged with free neighbours"},
    {"largest_free_bytes", (PyCFunction)Alloc_largest_free_bytes, METH_NOARGS, NULL},
    {"free_extents", (PyCFunction)Alloc_free_extents, METH_NOARGS,
     "the free extents, by offset"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Alloc_getset[] = {
    {"used_bytes", (getter)Alloc_get_used, NULL, "bytes in allocated extents", NULL},
    {"capacity_bytes", (getter)Alloc_get_capacity, NULL, NULL, NULL},
    {"alignment_bytes", (getter)Alloc_get_alignment, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Alloc_slots[] = {
    {Py_tp_doc, "ExtentAllocator(capacity_bytes, alignment_bytes=4096): best fit, native"},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Alloc_init},
    {Py_tp_dealloc, Alloc_dealloc},
    {Py_tp_methods, Alloc_methods},
    {Py_tp_getset, Alloc_getset},
    {0, NULL},
};

static PyType_Spec Alloc_spec = {
    .name = "kvtier.tiers._alloc_native.ExtentAllocator",
    .basicsize = sizeof(Alloc),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = Alloc_slots,
};

static int module_exec(PyObject *m)
{
    PyObject *type = PyType_FromSpec(&Alloc_spec);
    if (type == NULL)
        return -1;
    if (PyModule_AddObject(m, "ExtentAllocator", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_alloc_native",
    .m_doc = "The DRAM arena's best-fit extent allocator in C; see kvtier/tiers/allocator.py.",
    .m_size = 0,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__alloc_native(void)
{
    return PyModuleDef_Init(&module);
}
