/* DenseChainArc: a tenant's DRAM order (DenseOrder over PackedChainArc,
 * kvtier/index/dense_order.py and kvtier/index/packed_arc.py) as one native object.
 *
 * Why: a streamed block enters and leaves this order once each, and in Python that is
 * ~20-30 us of the daemon loop's ~130-160 a block (three layers of calls, a dozen list
 * links, four digest tables). Here it is a few hundred nanoseconds plus the Python
 * callbacks the contract needs (the caller's `evictable`, the sketch's count, the
 * catalog's digest).
 *
 * Same decisions for the same calls as the Python pair (tests/index/
 * test_arc_native.py replays random call sequences against it). Nothing here depends on
 * the numbering of local slots, so locals are handed out as the Python ones are (a free
 * list, then the end) only for tidiness. A block's key digest is read once, when it
 * enters, and kept: a catalog slot keeps its key while it is in a tier's order.
 *
 * Per block: one Node (48 B) while it is in the order or named as a parent, one entry
 * of the slot map, and at most one entry in each digest table (shadow: as many digests
 * as blocks in the order; each ghost list: as many again). Arrays live in anonymous
 * mappings grown by mremap, so growing leaves no freed copy in the heap.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
/* the stable ABI of 3.11: one wheel (cp311-abi3) for every CPython from 3.11 */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define PROBATION 0
#define PROTECTED 1
#define TAIL 2
#define LISTS 3
#define NONE (-1)

#include "_native_tables.h"

/* f(arg): PyObject_CallOneArg is not in 3.11's stable ABI */
static inline PyObject *call1(PyObject *f, PyObject *arg)
{
    return PyObject_CallFunctionObjArgs(f, arg, NULL);
}

/* ---- the order ------------------------------------------------------------------------ */

typedef struct {
    uint64_t digest;
    int64_t tick;
    int64_t global; /* catalog slot; NONE: the local is free */
    int32_t parent; /* the parent's local slot, NONE: none */
    int32_t kids;   /* blocks in the order naming this one as parent */
    int32_t pos;
    int32_t prev, next;   /* the ARC lists: node ids 0..2 sentinels, local + 3 */
    int32_t rprev, rnext; /* recency (safety net): node id 0 sentinel, local + 1 */
    uint8_t list;         /* 0: not in the order, else the ARC list + 1 */
} Node;

typedef struct {
    PyObject_HEAD
    PyObject *digest_of; /* catalog slot -> key digest */
    PyObject *count;     /* key digest -> uses (the sketch's count) */
    Mapped nodes;        /* Node[] */
    int32_t nodes_made;
    int32_t free_local; /* chained through `parent`; NONE: none */
    SlotMap locals;
    int32_t sent_prev[LISTS], sent_next[LISTS];
    int32_t rsent_prev, rsent_next;
    Py_ssize_t lens[LISTS];
    Py_ssize_t len;
    int64_t clock;
    int32_t deep;
    int32_t deep_position;
    DigestSet ghosts[LISTS];
    DigestSet shadow;
    double target, weight, credit, step;
    int64_t returns[LISTS][2]; /* [kind][0]: evicted from, [1]: came back to (PROBATION, TAIL) */
} Order;

#define NODES(o) ((Node *)(o)->nodes.p)

static inline int32_t *arc_prev(Order *o, int32_t id)
{
    return id < LISTS ? &o->sent_prev[id] : &NODES(o)[id - LISTS].prev;
}
static inline int32_t *arc_next(Order *o, int32_t id)
{
    return id < LISTS ? &o->sent_next[id] : &NODES(o)[id - LISTS].next;
}
static inline int32_t *rec_prev(Order *o, int32_t id)
{
    return id == 0 ? &o->rsent_prev : &NODES(o)[id - 1].rprev;
}
static inline int32_t *rec_next(Order *o, int32_t id)
{
    return id == 0 ? &o->rsent_next : &NODES(o)[id - 1].rnext;
}

static inline void arc_unlink(Order *o, int32_t id)
{
    int32_t before = *arc_prev(o, id), after = *arc_next(o, id);
    *arc_next(o, before) = after;
    *arc_prev(o, after) = before;
}
static inline void arc_link_last(Order *o, int32_t sentinel, int32_t id)
{
    int32_t last = *arc_prev(o, sentinel);
    *arc_prev(o, id) = last;
    *arc_next(o, id) = sentinel;
    *arc_next(o, last) = id;
    *arc_prev(o, sentinel) = id;
}
static inline void rec_unlink(Order *o, int32_t id)
{
    int32_t before = *rec_prev(o, id), after = *rec_next(o, id);
    *rec_next(o, before) = after;
    *rec_prev(o, after) = before;
}
static inline void rec_link_last(Order *o, int32_t id)
{
    int32_t last = o->rsent_prev;
    *rec_prev(o, id) = last;
    *rec_next(o, id) = 0;
    *rec_next(o, last) = id;
    o->rsent_prev = id;
}

/* the local of a catalog slot, made if it has none; NONE with an exception set */
static int32_t local_of(Order *o, int64_t global)
{
    int32_t local = smap_get(&o->locals, global);
    if (local != NONE)
        return local;
    if (o->free_local != NONE) {
        local = o->free_local;
        o->free_local = NODES(o)[local].parent;
    } else {
        if (o->nodes_made == INT32_MAX - LISTS) {
            PyErr_SetString(PyExc_OverflowError, "order full");
            return NONE;
        }
        local = o->nodes_made;
        if (mapped_reserve(&o->nodes, ((size_t)local + 1) * sizeof(Node)) < 0)
            return NONE;
        o->nodes_made++;
    }
    if (smap_add(&o->locals, global, local) < 0) {
        Node *n = &NODES(o)[local]; /* back to the free list */
        n->global = NONE;
        n->parent = o->free_local;
        o->free_local = local;
        return NONE;
    }
    Node *n = &NODES(o)[local];
    memset(n, 0, sizeof(*n));
    n->global = global;
    n->parent = NONE;
    return local;
}

/* DenseOrder._maybe_free */
static void maybe_free(Order *o, int32_t local)
{
    Node *n = &NODES(o)[local];
    if (n->list || n->kids > 0)
        return;
    smap_del(&o->locals, n->global);
    n->global = NONE;
    n->parent = o->free_local;
    o->free_local = local;
}

/* DenseOrder._left */
static void left(Order *o, int32_t local)
{
    int32_t parent = NODES(o)[local].parent;
    maybe_free(o, local);
    if (parent != NONE && NODES(o)[parent].global != NONE)
        maybe_free(o, parent);
}

static void place(Order *o, int32_t local, int kind)
{
    Node *n = &NODES(o)[local];
    int32_t id = local + LISTS;
    if (n->list) {
        o->lens[n->list - 1]--;
        arc_unlink(o, id);
    }
    n->list = (uint8_t)(kind + 1);
    o->lens[kind]++;
    arc_link_last(o, kind, id);
}

static inline Py_ssize_t at_least_one(Py_ssize_t n) { return n > 1 ? n : 1; }

/* PackedChainArc._touch; -1 with an exception set (the sketch's count failed) */
static int touch(Order *o, int32_t local, int hit)
{
    int32_t id = local + 1;
    if (hit)
        rec_unlink(o, id);
    rec_link_last(o, id);
    uint64_t digest = NODES(o)[local].digest;
    int seen = dset_exchange(&o->shadow, digest);
    if (seen < 0)
        return -1;
    if (seen != hit) {
        double w = o->weight + (hit ? o->step : -o->step);
        o->weight = w < 0.0 ? 0.0 : (w > 1.0 ? 1.0 : w);
    }
    dset_trim(&o->shadow, at_least_one(o->len));
    o->clock++;
    Node *n = &NODES(o)[local];
    n->tick = o->clock;
    int32_t position = n->pos;
    if (n->parent < 0) {
        int32_t deep = o->deep;
        if (deep >= 0 && deep != local && NODES(o)[deep].list)
            place(o, deep, TAIL);
        o->deep = local;
        o->deep_position = position;
    } else if (position >= o->deep_position) {
        o->deep = local;
        o->deep_position = position;
    }
    PyObject *key = PyLong_FromUnsignedLongLong(digest);
    if (key == NULL)
        return -1;
    PyObject *uses_obj = call1(o->count, key);
    Py_DECREF(key);
    if (uses_obj == NULL)
        return -1;
    long uses = PyLong_AsLong(uses_obj);
    Py_DECREF(uses_obj);
    if (uses == -1 && PyErr_Occurred())
        return -1;
    place(o, local, uses > 1 ? PROTECTED : PROBATION);
    return 0;
}

/* PackedChainArc.remove of a local in the order */
static void arc_remove(Order *o, int32_t local)
{
    Node *n = &NODES(o)[local];
    arc_unlink(o, local + LISTS);
    rec_unlink(o, local + 1);
    o->lens[n->list - 1]--;
    n->list = 0;
    o->len--;
    if (local == o->deep)
        o->deep = NONE;
    if (n->parent >= 0)
        NODES(o)[n->parent].kids--;
}

static int32_t evicted(Order *o, int32_t chosen, int kind)
{
    if (kind != PROTECTED)
        o->returns[kind][0]++;
    arc_remove(o, chosen);
    DigestSet *ghosts = &o->ghosts[kind];
    if (dset_exchange(ghosts, NODES(o)[chosen].digest) < 0) /* last in its ghosts */
        return NONE;
    dset_trim(ghosts, at_least_one(o->len));
    return chosen;
}

/* evictable(global) as a C truth value: 1, 0, or -1 with an exception set */
static int ask(PyObject *evictable, int64_t global)
{
    PyObject *slot = PyLong_FromLongLong(global);
    if (slot == NULL)
        return -1;
    PyObject *answer = call1(evictable, slot);
    Py_DECREF(slot);
    if (answer == NULL)
        return -1;
    int truth = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return truth;
}

#define RECENCY LISTS /* first_evictable's list: the safety net's, least recent first */

/* The first block of `list` (an ARC list, or RECENCY) that `evictable` takes and, with
 * `leaves`, that no block names as parent (PackedChainArc._first_leaf, first_slot); NONE
 * if none, -2 with an exception set. */
static int32_t first_evictable(Order *o, int list, int leaves, PyObject *evictable)
{
    int recency = list == RECENCY;
    int32_t end = recency ? 0 : list;
    int32_t id = recency ? o->rsent_next : o->sent_next[list];
    while (id != end) {
        int32_t local = recency ? id - 1 : id - LISTS;
        if (!leaves || !NODES(o)[local].kids) {
            int truth = ask(evictable, NODES(o)[local].global);
            if (truth < 0)
                return -2;
            if (truth)
                return local;
        }
        /* re-read: the callback may have grown the arrays */
        id = recency ? *rec_next(o, id) : *arc_next(o, id);
    }
    return NONE;
}

static int tails_first(Order *o)
{
    int64_t *tails = o->returns[TAIL], *probation = o->returns[PROBATION];
    return (tails[1] + 1) * (probation[0] + 2) <= (probation[1] + 1) * (tails[0] + 2);
}

/* DenseOrder._chosen */
static PyObject *chosen_result(Order *o, int32_t local)
{
    if (local == NONE) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    int64_t global = NODES(o)[local].global;
    left(o, local);
    return PyLong_FromLongLong(global);
}

/* ---- methods ------------------------------------------------------------------------- */

/* a subclass whose __init__ never ran has no arrays: refuse rather than crash */
#define REQUIRE_READY(o, fail)                                                            \
    do {                                                                                  \
        if ((o)->nodes.p == NULL) {                                                       \
            PyErr_SetString(PyExc_RuntimeError, "DenseChainArc.__init__ was not called"); \
            return fail;                                                                  \
        }                                                                                 \
    } while (0)

static int64_t slot_arg(PyObject *obj, int *ok)
{
    long long v = PyLong_AsLongLong(obj);
    *ok = !(v == -1 && PyErr_Occurred());
    return v;
}

/* digest_of(slot) into *digest: 0, or -1 with an exception set */
static int digest_of_slot(Order *o, int64_t slot, uint64_t *digest)
{
    PyObject *slot_obj = PyLong_FromLongLong(slot);
    if (slot_obj == NULL)
        return -1;
    PyObject *digest_obj = call1(o->digest_of, slot_obj);
    Py_DECREF(slot_obj);
    if (digest_obj == NULL)
        return -1;
    *digest = PyLong_AsUnsignedLongLongMask(digest_obj);
    Py_DECREF(digest_obj);
    return *digest == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *Order_insert(Order *o, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    REQUIRE_READY(o, NULL);
    static const char *names[] = {"slot", "size_bytes", "position", "parent"};
    PyObject *vals[4] = {NULL, NULL, NULL, NULL};
    if (nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "insert takes at most 4 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        vals[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t given = PyTuple_Size(kwnames);
        for (Py_ssize_t k = 0; k < given; k++) {
            PyObject *kw = PyTuple_GetItem(kwnames, k);
            const char *name = kw == NULL ? NULL : PyUnicode_AsUTF8AndSize(kw, NULL);
            if (name == NULL)
                return NULL;
            int found = 0;
            for (int i = 0; i < 4; i++) {
                if (strcmp(name, names[i]) == 0 && vals[i] == NULL) {
                    vals[i] = args[nargs + k];
                    found = 1;
                }
            }
            if (!found) {
                PyErr_Format(PyExc_TypeError, "insert() got an unexpected argument '%s'", name);
                return NULL;
            }
        }
    }
    if (vals[0] == NULL || vals[1] == NULL) {
        PyErr_SetString(PyExc_TypeError, "insert() needs slot and size_bytes");
        return NULL;
    }
    int ok;
    int64_t slot = slot_arg(vals[0], &ok);
    if (!ok)
        return NULL;
    int64_t position = 0, parent = NONE;
    if (vals[2] != NULL) {
        position = slot_arg(vals[2], &ok);
        if (!ok)
            return NULL;
    }
    if (vals[3] != NULL) {
        parent = slot_arg(vals[3], &ok);
        if (!ok)
            return NULL;
    }
    if (slot < 0) {
        PyErr_SetString(PyExc_ValueError, "slot must be >= 0");
        return NULL;
    }
    if (position < INT32_MIN || position > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "position out of range");
        return NULL;
    }
    if (parent < 0 && parent != NONE) {
        PyErr_SetString(PyExc_ValueError, "parent must be >= 0 or NO_SLOT");
        return NULL;
    }
    /* A block entering the order: its key's digest first, so that a failing callback
     * leaves nothing changed. */
    int32_t known = smap_get(&o->locals, slot);
    int entering = known == NONE || !NODES(o)[known].list;
    uint64_t digest = 0;
    if (entering && digest_of_slot(o, slot, &digest) < 0)
        return NULL;
    int32_t local = known != NONE ? known : local_of(o, slot);
    if (local == NONE)
        return NULL;
    int32_t up = NONE;
    if (parent != NONE && parent != slot) {
        up = local_of(o, parent);
        if (up == NONE) { /* out of memory */
            maybe_free(o, local);
            return NULL;
        }
    }
    Node *n = &NODES(o)[local];
    if (!entering) {
        /* in the order: a hit (DenseOrder leaves the parent as it was) */
        if (touch(o, local, 1) < 0)
            return NULL;
    } else {
        n->digest = digest;
        n->parent = up;
        o->len++;
        n->pos = (int32_t)position;
        if (up != NONE)
            NODES(o)[up].kids++;
        int kind = NONE;
        for (int k = 0; k < LISTS; k++) {
            if (dset_pop(&o->ghosts[k], digest)) {
                kind = k;
                break;
            }
        }
        if (kind == PROBATION || kind == PROTECTED) {
            double young = (double)(o->ghosts[PROBATION].len + o->ghosts[TAIL].len);
            double old = (double)o->ghosts[PROTECTED].len;
            if (kind == PROBATION) {
                double step = old / (young + 1);
                double t = o->target + (step > 1.0 ? step : 1.0);
                o->target = t < (double)o->len ? t : (double)o->len;
            } else {
                double step = young / (old + 1);
                double t = o->target - (step > 1.0 ? step : 1.0);
                o->target = t > 0.0 ? t : 0.0;
            }
        }
        if (kind >= 0 && kind != PROTECTED)
            o->returns[kind][1]++;
        if (touch(o, local, 0) < 0)
            return NULL;
    }
    if (up != NONE)
        maybe_free(o, up); /* not named after all (a hit) */
    Py_RETURN_NONE;
}

/* the local of a slot argument into *local (NONE: it has none): 0, or -1 with an
 * exception set */
static int local_arg(Order *o, PyObject *arg, int32_t *local)
{
    REQUIRE_READY(o, -1);
    int ok;
    int64_t slot = slot_arg(arg, &ok);
    if (!ok)
        return -1;
    *local = slot < 0 ? NONE : smap_get(&o->locals, slot);
    return 0;
}

static PyObject *Order_hit(Order *o, PyObject *arg)
{
    int32_t local;
    if (local_arg(o, arg, &local) < 0)
        return NULL;
    if (local != NONE && NODES(o)[local].list) {
        if (touch(o, local, 1) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Order_remove(Order *o, PyObject *arg)
{
    int32_t local;
    if (local_arg(o, arg, &local) < 0)
        return NULL;
    if (local != NONE) {
        if (NODES(o)[local].list)
            arc_remove(o, local);
        left(o, local);
    }
    Py_RETURN_NONE;
}

static PyObject *Order_victim(Order *o, PyObject *evictable)
{
    REQUIRE_READY(o, NULL);
    o->credit += o->weight;
    if (o->credit < 1.0) {
        int32_t local = first_evictable(o, RECENCY, 1, evictable);
        if (local == -2)
            return NULL;
        if (local != NONE)
            return chosen_result(o, evicted(o, local, NODES(o)[local].list - 1));
    }
    o->credit = o->credit - 1.0 > 0.0 ? o->credit - 1.0 : 0.0;
    int32_t chosen = NONE;
    int kind = TAIL;
    int tails = tails_first(o);
    if (tails) {
        chosen = first_evictable(o, TAIL, 1, evictable);
        if (chosen == -2)
            return NULL;
    }
    if (chosen < 0) {
        int32_t young = first_evictable(o, PROBATION, 1, evictable);
        if (young == -2)
            return NULL;
        kind = PROBATION;
        if (!tails) {
            int32_t tail = first_evictable(o, TAIL, 1, evictable);
            if (tail == -2)
                return NULL;
            if (tail >= 0 && (young < 0 || NODES(o)[tail].tick < NODES(o)[young].tick)) {
                young = tail;
                kind = TAIL;
            }
        }
        int32_t old = first_evictable(o, PROTECTED, 1, evictable);
        if (old == -2)
            return NULL;
        double probation = (double)(o->lens[PROBATION] + o->lens[TAIL]);
        if (old >= 0 && (young < 0 || probation <= o->target)) {
            young = old;
            kind = PROTECTED;
        }
        chosen = young;
    }
    if (chosen < 0)
        Py_RETURN_NONE;
    return chosen_result(o, evicted(o, chosen, kind));
}

static PyObject *Order_last_resort(Order *o, PyObject *evictable)
{
    REQUIRE_READY(o, NULL);
    int32_t local = first_evictable(o, RECENCY, 0, evictable);
    if (local == -2)
        return NULL;
    if (local == NONE)
        Py_RETURN_NONE;
    return chosen_result(o, evicted(o, local, NODES(o)[local].list - 1));
}

static int32_t local_in(Order *o, PyObject *arg)
{
    if (!PyLong_Check(arg))
        return NONE;
    int overflow;
    long long slot = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (overflow || slot < 0)
        return NONE;
    return smap_get(&o->locals, slot);
}

static PyObject *Order_names_as_parent(Order *o, PyObject *arg)
{
    REQUIRE_READY(o, NULL);
    int32_t local = local_in(o, arg);
    return PyBool_FromLong(local != NONE && NODES(o)[local].kids > 0);
}

static PyObject *Order_tails_first(Order *o, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(tails_first(o));
}

static PyObject *Order_state(Order *o, PyObject *Py_UNUSED(ignored))
{
    /* for tests: the lengths the Python pair keeps (lists, ghosts, shadow, locals) */
    return Py_BuildValue(
        "{s:(nnn),s:(nnn),s:n,s:n}",
        "lists", o->lens[0], o->lens[1], o->lens[2],
        "ghosts", o->ghosts[0].len, o->ghosts[1].len, o->ghosts[2].len,
        "shadow", o->shadow.len,
        "locals", o->locals.len);
}

static int Order_contains(Order *o, PyObject *arg)
{
    REQUIRE_READY(o, -1);
    int32_t local = local_in(o, arg);
    return local != NONE && NODES(o)[local].list > 0;
}

static Py_ssize_t Order_len(Order *o) { return o->len; }

static int Order_init(Order *o, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"digest_of", "count", "step", NULL};
    PyObject *digest_of, *count;
    double step;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOd", kwlist, &digest_of, &count, &step))
        return -1;
    if (o->nodes.p != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "DenseChainArc is initialised once");
        return -1;
    }
    Py_INCREF(digest_of);
    Py_INCREF(count);
    o->digest_of = digest_of;
    o->count = count;
    o->step = step;
    o->weight = 1.0;
    o->deep = NONE;
    o->deep_position = -1;
    o->free_local = NONE;
    for (int k = 0; k < LISTS; k++)
        o->sent_prev[k] = o->sent_next[k] = k;
    if (mapped_reserve(&o->nodes, 64 * sizeof(Node)) < 0 || smap_init(&o->locals) < 0 ||
        dset_init(&o->shadow) < 0)
        return -1;
    for (int k = 0; k < LISTS; k++)
        if (dset_init(&o->ghosts[k]) < 0)
            return -1;
    return 0;
}

static int Order_traverse(Order *o, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)o)); /* a heap type (PyType_FromSpec): its instances hold it */
    Py_VISIT(o->digest_of);
    Py_VISIT(o->count);
    return 0;
}

static int Order_clear(Order *o)
{
    Py_CLEAR(o->digest_of);
    Py_CLEAR(o->count);
    return 0;
}

static void Order_dealloc(Order *o)
{
    PyObject_GC_UnTrack((PyObject *)o);
    Order_clear(o);
    mapped_free(&o->nodes);
    mapped_free(&o->locals.entries);
    dset_free(&o->shadow);
    for (int k = 0; k < LISTS; k++)
        dset_free(&o->ghosts[k]);
    PyTypeObject *type = Py_TYPE((PyObject *)o);
    freefunc free_fn = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_fn(o);
    Py_DECREF(type);
}

static PyMethodDef Order_methods[] = {
    {"insert", (PyCFunction)(void (*)(void))Order_insert, METH_FASTCALL | METH_KEYWORDS,
     "insert(slot, size_bytes, position=0, parent=NO_SLOT): SlotPolicy.insert"},
    {"hit", (PyCFunction)Order_hit, METH_O, "SlotPolicy.hit"},
    {"remove", (PyCFunction)Order_remove, METH_O, "SlotPolicy.remove"},
    {"victim", (PyCFunction)Order_victim, METH_O, "SlotPolicy.victim"},
    {"last_resort", (PyCFunction)Order_last_resort, METH_O, "SlotPolicy.last_resort"},
    {"names_as_parent", (PyCFunction)Order_names_as_parent, METH_O,
     "SlotPolicy.names_as_parent"},
    {"tails_first", (PyCFunction)Order_tails_first, METH_NOARGS, "ChainArcPolicy.tails_first"},
    {"state", (PyCFunction)Order_state, METH_NOARGS, "sizes of the inner structures (tests)"},
    {NULL, NULL, 0, NULL},
};

static PyObject *Order_get_target(Order *o, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(o->target);
}

static PyObject *Order_get_weight(Order *o, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(o->weight);
}

static PyGetSetDef Order_getset[] = {
    {"target", (getter)Order_get_target, NULL, "ARC's target for the probation lists", NULL},
    {"weight", (getter)Order_get_weight, NULL, "the safety net's share", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Order_slots[] = {
    {Py_tp_doc, "DenseChainArc(digest_of, count, step): DenseOrder over PackedChainArc, native"},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Order_init},
    {Py_tp_dealloc, Order_dealloc},
    {Py_tp_traverse, Order_traverse},
    {Py_tp_clear, Order_clear},
    {Py_tp_methods, Order_methods},
    {Py_tp_getset, Order_getset},
    {Py_sq_length, Order_len},
    {Py_sq_contains, Order_contains},
    {0, NULL},
};

static PyType_Spec Order_spec = {
    .name = "kvtier.index._arc_native.DenseChainArc",
    .basicsize = sizeof(Order),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = Order_slots,
};

static int module_exec(PyObject *m)
{
    PyObject *type = PyType_FromSpec(&Order_spec);
    if (type == NULL)
        return -1;
    if (PyModule_AddObject(m, "DenseChainArc", type) < 0) {
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
    .m_name = "_arc_native",
    .m_doc = "A tenant's DRAM order (DenseOrder over PackedChainArc) in C; see dense_order.py.",
    .m_size = 0,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__arc_native(void)
{
    return PyModuleDef_Init(&module);
}
