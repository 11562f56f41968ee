/* A demotion batch's work on its I/O thread, in C (kvtier/tiers/record_batch.py): each
 * block checked against the xxh3-64 its put stored, and each record's header encoded.
 *
 * Why: the daemon is bound by the GIL, not by one thread. A streamed 64 KiB block costs
 * its wall time in the loop's CPU plus most of the Python its I/O thread runs for it:
 * 10 us more Python a record on an I/O thread was ~8 us more wall a block
 * (BENCHMARKS.md, "A demotion batch's checks and headers in C"). In Python a record's
 * check (the xxhash package holds the GIL over 64 KiB and less) and header (a struct,
 * slices of a memoryview, a second hash) were ~5 us of it. Here a batch's checks run
 * with the GIL let go once, and its headers in one call.
 *
 * xxHash is the header and x86 dispatcher of the xxhash 4.1.0 sdist (xxHash 0.8.4, BSD
 * 2-clause: ../_vendor/xxhash.LICENSE), inlined; XXH3_64bits is the function the xxhash
 * package computes, so the digests are the stored ones (tests/tiers/test_record_batch.py
 * compares both functions with the Python they stand for).
 */
#define PY_SSIZE_T_CLEAN
/* the stable ABI of 3.11, as kvtier/index/_arc_native.c */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* On x86 the vendored dispatcher picks AVX2 (or AVX-512) at run time, as the xxhash
 * package's wheel does: SSE2 alone takes ~2.5x as long over 64 KiB. */
#if defined(__x86_64__) || defined(_M_X64)
#include "../_vendor/xxh_x86dispatch.c" /* with xxhash.h, inlined */
#define HASH XXH3_64bits_dispatch
#define HASH_UPDATE XXH3_64bits_update_dispatch
#else
#define XXH_INLINE_ALL
#include "../_vendor/xxhash.h"
#define HASH XXH3_64bits
#define HASH_UPDATE XXH3_64bits_update
#endif

/* Above this many bytes a batch's hashes let go of the GIL, as the xxhash package does
 * for one input: taking it back costs a wake-up and a wait for another thread's next
 * pause, which pays only over long work (a 64 KiB copy on the loop that let go of it
 * cost the loop ~8-10 us more CPU a block, not less). */
#define GIL_FREE_BYTES ((Py_ssize_t)64 << 10)

static PyObject *digest_of(XXH64_hash_t h)
{
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

/* ---- digests: a batch's payloads, hashed with the GIL released once ---------------------- */

typedef struct {
    Py_buffer *views; /* every payload's views, in order */
    Py_ssize_t *firsts; /* payload i's views are views[firsts[i] .. firsts[i + 1]) */
    Py_ssize_t *wanted; /* the bytes of payload i to hash */
    XXH64_hash_t *sums;
    Py_ssize_t payloads, held; /* views acquired so far */
} Batch;

static void batch_free(Batch *b)
{
    for (Py_ssize_t i = 0; i < b->held; i++)
        PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
    PyMem_Free(b->firsts);
    PyMem_Free(b->wanted);
    PyMem_Free(b->sums);
}

/* hold every view of `payloads` and read `nbytes`; -1 with an exception set on failure */
static int batch_take(Batch *b, PyObject *payloads, PyObject *nbytes)
{
    Py_ssize_t n = PySequence_Size(payloads);
    if (n < 0)
        return -1;
    if (PySequence_Size(nbytes) != n) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "digests: one byte count a payload");
        return -1;
    }
    b->payloads = n;
    b->firsts = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    b->wanted = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    b->sums = PyMem_Calloc((size_t)n + 1, sizeof(XXH64_hash_t));
    if (b->firsts == NULL || b->wanted == NULL || b->sums == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t cap = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *count = PySequence_GetItem(nbytes, i);
        if (count == NULL)
            return -1;
        b->wanted[i] = PyLong_AsSsize_t(count);
        Py_DECREF(count);
        if (b->wanted[i] < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "digests: a negative byte count");
            return -1;
        }
        PyObject *parts = PySequence_GetItem(payloads, i);
        if (parts == NULL)
            return -1;
        Py_ssize_t m = PySequence_Size(parts);
        if (m < 0) {
            Py_DECREF(parts);
            return -1;
        }
        if (b->held + m > cap) {
            Py_ssize_t grown = (cap + m) * 2;
            Py_buffer *views = PyMem_Realloc(b->views, (size_t)grown * sizeof(Py_buffer));
            if (views == NULL) {
                Py_DECREF(parts);
                PyErr_NoMemory();
                return -1;
            }
            b->views = views;
            cap = grown;
        }
        b->firsts[i] = b->held;
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *part = PySequence_GetItem(parts, j);
            if (part == NULL) {
                Py_DECREF(parts);
                return -1;
            }
            int bad = PyObject_GetBuffer(part, &b->views[b->held], PyBUF_SIMPLE);
            Py_DECREF(part);
            if (bad < 0) {
                Py_DECREF(parts);
                return -1;
            }
            b->held++;
        }
        Py_DECREF(parts);
    }
    b->firsts[n] = b->held;
    return 0;
}

/* each payload's first `wanted` bytes (fewer if its views hold fewer), hashed */
static void batch_hash(Batch *b)
{
    for (Py_ssize_t i = 0; i < b->payloads; i++) {
        Py_ssize_t first = b->firsts[i], last = b->firsts[i + 1], left = b->wanted[i];
        if (first == last) {
            b->sums[i] = HASH("", 0);
            continue;
        }
        if (last - first == 1 || b->views[first].len >= left) { /* one view: no state */
            Py_ssize_t len = b->views[first].len < left ? b->views[first].len : left;
            b->sums[i] = HASH(b->views[first].buf, (size_t)len);
            continue;
        }
        XXH3_state_t state;
        XXH3_INITSTATE(&state);
        XXH3_64bits_reset(&state);
        for (Py_ssize_t j = first; j < last && left > 0; j++) {
            Py_ssize_t len = b->views[j].len < left ? b->views[j].len : left;
            HASH_UPDATE(&state, b->views[j].buf, (size_t)len);
            left -= len;
        }
        b->sums[i] = XXH3_64bits_digest(&state);
    }
}

PyDoc_STRVAR(digests_doc,
             "digests(payloads, nbytes, /)\n--\n\n"
             "The xxh3-64 of the first nbytes[i] bytes of each payloads[i] (a sequence of "
             "buffers, taken as one run of bytes; all of them if they hold fewer), as a "
             "list: every buffer is held first, then the GIL released once for the batch.");

static PyObject *digests(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "digests(payloads, nbytes) takes two sequences");
        return NULL;
    }
    Batch b = {0};
    PyObject *out = NULL;
    if (batch_take(&b, args[0], args[1]) < 0)
        goto done;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < b.payloads; i++)
        total += b.wanted[i];
    if (total > GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS batch_hash(&b);
        Py_END_ALLOW_THREADS
    } else {
        batch_hash(&b);
    }
    out = PyList_New(b.payloads);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < b.payloads; i++) {
        PyObject *sum = digest_of(b.sums[i]);
        if (sum == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SetItem(out, i, sum);
    }
done:
    batch_free(&b);
    return out;
}

/* ---- encode_headers: a batch's record headers (kvtier/tiers/record.py's layout) --------- */

#define MAGIC "KVTREC01"
#define VERSION 1
#define FIXED_BYTES 48 /* record.py's _FIXED: <8sHHIQQQHHI */
#define SEAL_BYTES 52 /* crypto.py's SEAL: key id, salt, nonce, tag */
#define CHECKSUM_BYTES 8

static PyObject *name_ns_id, *name_key, *name_generation, *name_payload_bytes, *name_xxh3_64,
    *name_header_bytes, *name_codec;

static void put_le(unsigned char *at, uint64_t value, int bytes)
{
    for (int i = 0; i < bytes; i++)
        at[i] = (unsigned char)(value >> (8 * i));
}

/* an unsigned attribute of `header` no larger than `most`; -1 with an exception set if not */
static int attr_u64(PyObject *header, PyObject *name, uint64_t most, uint64_t *out)
{
    PyObject *value = PyObject_GetAttr(header, name);
    if (value == NULL)
        return -1;
    unsigned long long got = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    if (got == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (got > most) {
        PyErr_Format(PyExc_ValueError, "encode_headers: %R is %llu, above %llu", name, got,
                     (unsigned long long)most);
        return -1;
    }
    *out = got;
    return 0;
}

/* header `h` encoded at `region` (its header_bytes of room, already checked) */
static int encode_one(PyObject *h, unsigned char *buf, Py_ssize_t buf_len, Py_ssize_t start)
{
    uint64_t generation, payload_bytes, xxh3_64, header_bytes, codec;
    if (attr_u64(h, name_generation, UINT64_MAX, &generation) < 0 ||
        attr_u64(h, name_payload_bytes, UINT64_MAX, &payload_bytes) < 0 ||
        attr_u64(h, name_xxh3_64, UINT64_MAX, &xxh3_64) < 0 ||
        attr_u64(h, name_header_bytes, UINT32_MAX, &header_bytes) < 0 ||
        attr_u64(h, name_codec, UINT16_MAX, &codec) < 0)
        return -1;
    if (start < 0 || (uint64_t)start + header_bytes > (uint64_t)buf_len) {
        PyErr_Format(PyExc_ValueError, "encode_headers: a header of %llu bytes at %zd is past "
                     "the buffer's %zd", (unsigned long long)header_bytes, start, buf_len);
        return -1;
    }
    PyObject *ns_id = PyObject_GetAttr(h, name_ns_id);
    if (ns_id == NULL)
        return -1;
    PyObject *key = PyObject_GetAttr(h, name_key);
    if (key == NULL) {
        Py_DECREF(ns_id);
        return -1;
    }
    int rc = -1;
    Py_buffer k = {0};
    Py_ssize_t ns_len;
    const char *ns = PyUnicode_AsUTF8AndSize(ns_id, &ns_len);
    if (ns == NULL || PyObject_GetBuffer(key, &k, PyBUF_SIMPLE) < 0)
        goto done;
    if (ns_len > 0xFFFF || k.len > 0xFFFF ||
        (uint64_t)(FIXED_BYTES + ns_len + k.len + SEAL_BYTES + CHECKSUM_BYTES) > header_bytes) {
        PyErr_Format(PyExc_ValueError, "encode_headers: a namespace of %zd and a key of %zd "
                     "bytes do not fit a header of %llu", ns_len, k.len,
                     (unsigned long long)header_bytes);
        goto done;
    }
    unsigned char *at = buf + start;
    memset(at, 0, (size_t)header_bytes);
    memcpy(at, MAGIC, 8);
    put_le(at + 8, VERSION, 2);
    put_le(at + 10, codec, 2);
    put_le(at + 12, header_bytes, 4);
    put_le(at + 16, generation, 8);
    put_le(at + 24, payload_bytes, 8);
    put_le(at + 32, xxh3_64, 8);
    put_le(at + 40, (uint64_t)ns_len, 2);
    put_le(at + 42, (uint64_t)k.len, 2);
    put_le(at + 44, 0, 4); /* flags: plaintext */
    memcpy(at + FIXED_BYTES, ns, (size_t)ns_len);
    memcpy(at + FIXED_BYTES + ns_len, k.buf, (size_t)k.len);
    size_t end = (size_t)header_bytes - CHECKSUM_BYTES; /* the seal's room stays zero */
    put_le(at + end, HASH(at, end), 8);
    rc = 0;
done:
    if (k.obj != NULL)
        PyBuffer_Release(&k);
    Py_DECREF(key);
    Py_DECREF(ns_id);
    return rc;
}

PyDoc_STRVAR(encode_headers_doc,
             "encode_headers(buf, starts, headers, /)\n--\n\n"
             "record.encode_header of each plaintext header into buf at starts[i] (its "
             "header_bytes there cleared first).");

static PyObject *encode_headers(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "encode_headers(buf, starts, headers) takes three");
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = PySequence_Size(args[2]);
    if (n < 0)
        goto done;
    if (PySequence_Size(args[1]) != n) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "encode_headers: one start a header");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *start_obj = PySequence_GetItem(args[1], i);
        if (start_obj == NULL)
            goto done;
        Py_ssize_t start = PyLong_AsSsize_t(start_obj);
        Py_DECREF(start_obj);
        if (start == -1 && PyErr_Occurred())
            goto done;
        PyObject *header = PySequence_GetItem(args[2], i);
        if (header == NULL)
            goto done;
        int bad = encode_one(header, buf.buf, buf.len, start);
        Py_DECREF(header);
        if (bad < 0)
            goto done;
    }
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef module_methods[] = {
    {"digests", (PyCFunction)(void (*)(void))digests, METH_FASTCALL, digests_doc},
    {"encode_headers", (PyCFunction)(void (*)(void))encode_headers, METH_FASTCALL,
     encode_headers_doc},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m)
{
    /* interned once for every module object: the names never change */
    PyObject **names[] = {&name_ns_id, &name_key, &name_generation, &name_payload_bytes,
                          &name_xxh3_64, &name_header_bytes, &name_codec};
    const char *spelled[] = {"ns_id", "key", "generation", "payload_bytes",
                             "xxh3_64", "header_bytes", "codec"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i] == NULL && (*names[i] = PyUnicode_InternFromString(spelled[i])) == NULL)
            return -1;
    }
    return PyModule_AddIntConstant(m, "GIL_FREE_BYTES", (long)GIL_FREE_BYTES);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_batch_native",
    .m_doc = "A demotion batch's checks and record headers; see kvtier/tiers/record_batch.py.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__batch_native(void)
{
    return PyModuleDef_Init(&module);
}
