/* DirectoryCore: what kvtier/engine/directory.py's Directory does per block (publish,
 * unpublish, unpublish_extent), in C, over the same table in the same sealed memfd.
 *
 * Why: a streamed block is published when it is put and unpublished when it is demoted,
 * ~8-10 us of the daemon loop's ~110-150 a 64 KiB block in Python (two dicts, a list, a
 * probe loop and a dozen memoryview stores). Here the stores and lookups are C; the key's
 * digest stays the Python function both sides share (kvtier/_directory.py), called once a
 * publish.
 *
 * The table ends byte for byte as the Python one leaves it after the same calls (tests/
 * engine/test_directory_native.py compares the two tables after every call), so readers
 * (kvtier/client/zerocopy.py) cannot tell them apart. The seqlock's stores are release
 * stores, in the order the Python makes them.
 *
 * A block's id (namespace id, key) is kept per table slot (a strong reference), and
 * found again by its hash: an index of slot numbers, linear probing, at most half full,
 * backward-shift deletion. Neither is shown to the garbage collector: a block id is a
 * tuple of a str and bytes, which can be in no reference cycle, so a full collection has
 * nothing here to walk (the Python directory's dict and list it walked item by item).
 */
#define PY_SSIZE_T_CLEAN
/* the stable ABI of 3.11, as kvtier/index/_arc_native.c */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_native_u64map.h" /* U64Map: extent offset -> table slot */

/* the entry layout, kvtier/_directory.py's (checked against it by directory.py) */
#define ENTRY_WORDS 8
#define W_SEQ 0
#define W_DIGEST_LO 1
#define W_DIGEST_HI 2
#define W_OFFSET 3
#define W_SIZE 4
#define W_XXH3 5
#define W_GENERATION 6
#define PROBE_SLOTS 8

typedef struct {
    PyObject_HEAD
    Py_buffer table;
    int have_table;
    uint64_t *words;
    Py_ssize_t entries; /* a power of two */
    PyObject **owner;   /* block id per table slot (a strong reference); NULL: free */
    Py_hash_t *hashes;  /* owner's hash per table slot */
    int32_t *index;     /* table slot + 1 by the block id's hash; 0: empty */
    size_t index_mask;
    Py_ssize_t len;
    U64Map at_offset;
    uint64_t align;
    PyObject *key_digest;   /* (namespace: bytes, key: bytes) -> (low, high) */
    PyObject *namespace_of; /* namespace id -> its namespace encoded (bytes) */
    Py_ssize_t unpublished_full;
} Dir;

static inline void store(uint64_t *w, uint64_t v)
{
    __atomic_store_n(w, v, __ATOMIC_RELEASE);
}

#define REQUIRE_READY(d, err)                                                                  \
    do {                                                                                       \
        if (!(d)->have_table) {                                                                \
            PyErr_SetString(PyExc_RuntimeError, "the directory is closed (or was never opened)"); \
            return err;                                                                        \
        }                                                                                      \
    } while (0)

/* ---- block id -> table slot ------------------------------------------------------------ */

/* the index position holding `block_id` (found: *slot set), or the empty one it would
 * take; -1 with an exception set if comparing raised */
static Py_ssize_t index_find(Dir *d, PyObject *block_id, Py_hash_t h, Py_ssize_t *slot)
{
    size_t i = home_of((uint64_t)h, d->index_mask);
    *slot = -1;
    while (d->index[i] != 0) {
        Py_ssize_t s = d->index[i] - 1;
        if (d->hashes[s] == h) {
            int same = d->owner[s] == block_id ? 1
                                               : PyObject_RichCompareBool(d->owner[s], block_id, Py_EQ);
            if (same < 0)
                return -1;
            if (same) {
                *slot = s;
                return (Py_ssize_t)i;
            }
        }
        i = (i + 1) & d->index_mask;
    }
    return (Py_ssize_t)i;
}

/* index_find for `block_id`, its hash taken (into *h) */
static Py_ssize_t find_id(Dir *d, PyObject *block_id, Py_hash_t *h, Py_ssize_t *slot)
{
    *h = PyObject_Hash(block_id);
    if (*h == -1)
        return -1;
    return index_find(d, block_id, *h, slot);
}

static void index_delete_at(Dir *d, size_t i)
{
    size_t j = i;
    for (;;) { /* backward shift, as U64Map's map_del */
        j = (j + 1) & d->index_mask;
        if (d->index[j] == 0)
            break;
        size_t home = home_of((uint64_t)d->hashes[d->index[j] - 1], d->index_mask);
        if (!stays_after_hole(i, j, home)) {
            d->index[i] = d->index[j];
            i = j;
        }
    }
    d->index[i] = 0;
}

/* room for one more block id (the index kept at most half full) */
static int index_reserve(Dir *d)
{
    if (2 * ((size_t)d->len + 1) <= d->index_mask + 1)
        return 0;
    size_t size = 2 * (d->index_mask + 1);
    int32_t *grown = PyMem_Calloc(size, sizeof(int32_t));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i <= d->index_mask; i++)
        if (d->index[i] != 0) {
            size_t j = home_of((uint64_t)d->hashes[d->index[i] - 1], size - 1);
            while (grown[j] != 0)
                j = (j + 1) & (size - 1);
            grown[j] = d->index[i];
        }
    PyMem_Free(d->index);
    d->index = grown;
    d->index_mask = size - 1;
    return 0;
}

/* ---- the table -------------------------------------------------------------------------- */

static void clear_entry(Dir *d, Py_ssize_t slot, size_t index_pos)
{
    uint64_t *w = d->words + slot * ENTRY_WORDS;
    map_del(&d->at_offset, w[W_OFFSET]);
    uint64_t seq = w[W_SEQ];
    store(&w[W_SEQ], seq + 1); /* odd: a reader copying this block now will not keep it */
    for (int k = W_DIGEST_LO; k <= W_GENERATION; k++)
        store(&w[k], 0);
    store(&w[W_SEQ], seq + 2);
    index_delete_at(d, index_pos);
    Py_CLEAR(d->owner[slot]);
    d->len--;
}

static PyObject *Dir_unpublish(Dir *d, PyObject *block_id)
{
    REQUIRE_READY(d, NULL);
    Py_hash_t h;
    Py_ssize_t slot;
    Py_ssize_t pos = find_id(d, block_id, &h, &slot);
    if (pos < 0)
        return NULL;
    if (slot >= 0)
        clear_entry(d, slot, (size_t)pos);
    Py_RETURN_NONE;
}

static int u64_of(PyObject *v, uint64_t *out)
{
    unsigned long long n = PyLong_AsUnsignedLongLong(v);
    if (n == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = n;
    return 0;
}

/* publish(block_id, offset, size_bytes, xxh3_64, generation, namespace=None) -> bool */
static PyObject *Dir_publish(Dir *d, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    REQUIRE_READY(d, NULL);
    PyObject *namespace = nargs == 6 ? args[5] : Py_None;
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_Size(kwnames) : 0;
    if (nkw == 1 && nargs == 5 &&
        PyUnicode_CompareWithASCIIString(PyTuple_GetItem(kwnames, 0), "namespace") == 0) {
        namespace = args[5];
        nkw = 0;
    }
    if (nargs < 5 || nargs > 6 || nkw != 0) {
        PyErr_SetString(PyExc_TypeError,
                        "publish(block_id, offset, size_bytes, xxh3_64, generation, namespace=None)");
        return NULL;
    }
    PyObject *block_id = args[0];
    uint64_t offset, size_bytes, xxh3, generation;
    if (u64_of(args[1], &offset) < 0 || u64_of(args[2], &size_bytes) < 0 ||
        u64_of(args[3], &xxh3) < 0 || u64_of(args[4], &generation) < 0)
        return NULL;
    if (!PyTuple_Check(block_id) || PyTuple_Size(block_id) != 2) {
        PyErr_SetString(PyExc_TypeError, "a block id is a (namespace id, key) tuple");
        return NULL;
    }
    Py_hash_t h;
    Py_ssize_t slot;
    Py_ssize_t pos = find_id(d, block_id, &h, &slot);
    if (pos < 0)
        return NULL;
    if (slot >= 0) {
        uint64_t *w = d->words + slot * ENTRY_WORDS;
        if (w[W_OFFSET] == offset && w[W_GENERATION] == generation)
            Py_RETURN_TRUE; /* published already: a put's before its reply, then the catalog's */
    }
    PyObject *digest;
    PyObject *key = PyTuple_GetItem(block_id, 1);
    if (namespace != Py_None) {
        digest = PyObject_CallFunctionObjArgs(d->key_digest, namespace, key, NULL);
    } else {
        PyObject *encoded =
            PyObject_CallFunctionObjArgs(d->namespace_of, PyTuple_GetItem(block_id, 0), NULL);
        if (encoded == NULL)
            return NULL;
        digest = PyObject_CallFunctionObjArgs(d->key_digest, encoded, key, NULL);
        Py_DECREF(encoded);
    }
    if (digest == NULL)
        return NULL;
    uint64_t low = 0, high = 0;
    int bad = !PyTuple_Check(digest) || PyTuple_Size(digest) != 2 ||
              u64_of(PyTuple_GetItem(digest, 0), &low) < 0 ||
              u64_of(PyTuple_GetItem(digest, 1), &high) < 0;
    Py_DECREF(digest);
    if (bad) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "key_digest must return (low, high)");
        return NULL;
    }
    size_t mask = (size_t)d->entries - 1;
    if (slot < 0) { /* a free entry of the probe window, unless another key has this digest */
        Py_ssize_t free_slot = -1;
        for (uint64_t i = 0; i < PROBE_SLOTS; i++) {
            Py_ssize_t s = (Py_ssize_t)((low + i) & mask);
            if (d->owner[s] == NULL) {
                if (free_slot < 0)
                    free_slot = s;
            } else if (d->words[s * ENTRY_WORDS + W_DIGEST_LO] == low &&
                       d->words[s * ENTRY_WORDS + W_DIGEST_HI] == high) {
                free_slot = -1;
                break;
            }
        }
        if (free_slot < 0) {
            d->unpublished_full++;
            Py_RETURN_FALSE;
        }
        if (map_put(&d->at_offset, offset, (uint64_t)free_slot) < 0)
            return NULL; /* out of memory: nothing changed */
        if (index_reserve(d) < 0) {
            map_del(&d->at_offset, offset);
            return NULL;
        }
        pos = index_find(d, block_id, h, &slot); /* where it goes in the (maybe grown) index */
        if (pos < 0)
            return NULL;
        slot = free_slot;
        Py_INCREF(block_id);
        d->owner[slot] = block_id;
        d->hashes[slot] = h;
        d->index[pos] = (int32_t)(slot + 1);
        d->len++;
    } else {
        uint64_t old = d->words[slot * ENTRY_WORDS + W_OFFSET];
        if (old != offset)
            map_del(&d->at_offset, old);
        if (map_put(&d->at_offset, offset, (uint64_t)slot) < 0)
            return NULL;
        PyObject *was = d->owner[slot]; /* an equal id: the caller's object from now on */
        Py_INCREF(block_id);
        d->owner[slot] = block_id;
        Py_DECREF(was);
    }
    uint64_t *w = d->words + slot * ENTRY_WORDS;
    uint64_t seq = w[W_SEQ];
    store(&w[W_SEQ], (seq + 1) | 1); /* odd: readers of this entry retry */
    store(&w[W_DIGEST_LO], low);
    store(&w[W_DIGEST_HI], high);
    store(&w[W_OFFSET], offset);
    store(&w[W_SIZE], size_bytes);
    store(&w[W_XXH3], xxh3);
    store(&w[W_GENERATION], generation);
    store(&w[W_SEQ], (seq | 1) + 1); /* even again, and never 0 */
    Py_RETURN_TRUE;
}

/* unpublish the block whose extent starts at `offset` (at_offset's entry: `slot`); the
 * entry goes whatever it names, so a walk over at_offset always moves on */
static int unpublish_at(Dir *d, uint64_t offset, Py_ssize_t slot)
{
    if (d->owner[slot] != NULL && d->words[slot * ENTRY_WORDS + W_OFFSET] == offset) {
        Py_ssize_t ignored;
        Py_ssize_t pos = index_find(d, d->owner[slot], d->hashes[slot], &ignored);
        if (pos < 0)
            return -1;
        clear_entry(d, slot, (size_t)pos);
    }
    map_del(&d->at_offset, offset);
    return 0;
}

/* unpublish_extent(extent): unpublish every block that starts inside it */
static PyObject *Dir_unpublish_extent(Dir *d, PyObject *extent)
{
    REQUIRE_READY(d, NULL);
    if (d->at_offset.len == 0)
        Py_RETURN_NONE;
    uint64_t start, size;
    PyObject *v = PyObject_GetAttrString(extent, "offset");
    if (v == NULL)
        return NULL;
    int bad = u64_of(v, &start) < 0;
    Py_DECREF(v);
    if (bad)
        return NULL;
    v = PyObject_GetAttrString(extent, "size_bytes");
    if (v == NULL)
        return NULL;
    bad = u64_of(v, &size) < 0;
    Py_DECREF(v);
    if (bad)
        return NULL;
    uint64_t end = start + size, slot;
    if (size / d->align <= d->at_offset.len) { /* the cheaper walk, as the Python's */
        for (uint64_t o = start; o < end; o += d->align)
            if (map_get(&d->at_offset, o, &slot) && unpublish_at(d, o, (Py_ssize_t)slot) < 0)
                return NULL;
    } else {
        U64Map *m = &d->at_offset;
        size_t i = 0;
        while (i <= m->mask) { /* a clear shifts later entries back into i: look again */
            uint64_t k = m->keys[i];
            if (k == 0 || k - 1 < start || k - 1 >= end) {
                i++;
                continue;
            }
            if (unpublish_at(d, k - 1, (Py_ssize_t)m->vals[i]) < 0)
                return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Dir_release(Dir *d, PyObject *Py_UNUSED(ignored))
{
    /* unpublish nothing, let go of the table (its mapping can then be closed) */
    if (d->owner != NULL)
        for (Py_ssize_t s = 0; s < d->entries; s++)
            Py_CLEAR(d->owner[s]);
    PyMem_Free(d->owner);
    PyMem_Free(d->hashes);
    PyMem_Free(d->index);
    map_free(&d->at_offset);
    d->owner = NULL;
    d->hashes = NULL;
    d->index = NULL;
    d->len = 0;
    if (d->have_table) {
        PyBuffer_Release(&d->table);
        d->have_table = 0;
        d->words = NULL;
    }
    Py_RETURN_NONE;
}

static int Dir_init(Dir *d, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"table", "entries", "key_digest", "namespace_of", "align_bytes", NULL};
    PyObject *table, *key_digest, *namespace_of;
    Py_ssize_t entries;
    unsigned long long align;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnOOK", kwlist, &table, &entries, &key_digest,
                                     &namespace_of, &align))
        return -1;
    if (d->have_table) {
        PyErr_SetString(PyExc_RuntimeError, "a DirectoryCore is opened once");
        return -1;
    }
    if (entries <= 0 || (entries & (entries - 1)) || entries > (1 << 30) || align == 0) {
        PyErr_SetString(PyExc_ValueError, "a directory's entries must be a power of two");
        return -1;
    }
    if (PyObject_GetBuffer(table, &d->table, PyBUF_WRITABLE) < 0)
        return -1;
    d->have_table = 1;
    if (d->table.len < entries * ENTRY_WORDS * 8 || ((uintptr_t)d->table.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "the table is smaller than its entries (or unaligned)");
        return -1;
    }
    d->words = (uint64_t *)d->table.buf;
    d->entries = entries;
    d->align = align;
    d->owner = PyMem_Calloc((size_t)entries, sizeof(PyObject *));
    d->hashes = PyMem_Calloc((size_t)entries, sizeof(Py_hash_t));
    d->index = PyMem_Calloc(64, sizeof(int32_t));
    d->index_mask = 63;
    if (d->owner == NULL || d->hashes == NULL || d->index == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (map_init(&d->at_offset, 64) < 0)
        return -1;
    Py_INCREF(key_digest);
    d->key_digest = key_digest;
    Py_INCREF(namespace_of);
    d->namespace_of = namespace_of;
    return 0;
}

static int Dir_traverse(Dir *d, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)d));
    Py_VISIT(d->key_digest);
    Py_VISIT(d->namespace_of);
    return 0;
}

static int Dir_clear(Dir *d)
{
    Py_CLEAR(d->key_digest);
    Py_CLEAR(d->namespace_of);
    return 0;
}

static void Dir_dealloc(Dir *d)
{
    PyObject_GC_UnTrack((PyObject *)d);
    Dir_clear(d);
    PyObject *ignored = Dir_release(d, NULL);
    Py_XDECREF(ignored);
    PyTypeObject *type = Py_TYPE((PyObject *)d);
    freefunc free_fn = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_fn(d);
    Py_DECREF(type);
}

static Py_ssize_t Dir_len(Dir *d) { return d->len; }

static PyObject *Dir_get_unpublished_full(Dir *d, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(d->unpublished_full);
}

static PyMethodDef Dir_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))Dir_publish, METH_FASTCALL | METH_KEYWORDS,
     "Directory.publish"},
    {"unpublish", (PyCFunction)Dir_unpublish, METH_O, "Directory.unpublish"},
    {"unpublish_extent", (PyCFunction)Dir_unpublish_extent, METH_O, "Directory.unpublish_extent"},
    {"release", (PyCFunction)Dir_release, METH_NOARGS,
     "let go of the table and every block id (before the mapping is closed)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Dir_getset[] = {
    {"unpublished_full", (getter)Dir_get_unpublished_full, NULL,
     "blocks not published: their probe window was full", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Dir_slots[] = {
    {Py_tp_doc, "DirectoryCore(table, entries, key_digest, namespace_of, align_bytes)"},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Dir_init},
    {Py_tp_dealloc, Dir_dealloc},
    {Py_tp_traverse, Dir_traverse},
    {Py_tp_clear, Dir_clear},
    {Py_tp_methods, Dir_methods},
    {Py_tp_getset, Dir_getset},
    {Py_sq_length, Dir_len},
    {0, NULL},
};

static PyType_Spec Dir_spec = {
    .name = "kvtier.engine._directory_native.DirectoryCore",
    .basicsize = sizeof(Dir),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = Dir_slots,
};

static int module_exec(PyObject *m)
{
    PyObject *type = PyType_FromSpec(&Dir_spec);
    if (type == NULL)
        return -1;
    if (PyModule_AddObject(m, "DirectoryCore", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    PyObject *layout = Py_BuildValue("(iiiiiiiii)", W_SEQ, W_DIGEST_LO, W_DIGEST_HI, W_OFFSET,
                                     W_SIZE, W_XXH3, W_GENERATION, ENTRY_WORDS, PROBE_SLOTS);
    if (layout == NULL || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
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
    .m_name = "_directory_native",
    .m_doc = "A tenant's directory's per-block work in C; see kvtier/engine/directory.py.",
    .m_size = 0,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__directory_native(void)
{
    return PyModuleDef_Init(&module);
}
