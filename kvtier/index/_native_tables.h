/* The tables under kvtier/index/_arc_native.c's order, in anonymous mappings grown by
 * mremap (no freed copy left in the heap when one grows): `DigestSet`, an ordered set of
 * 64-bit key digests (what DigestTable, kvtier/index/slots.py, is to the ARC's shadow and
 * ghosts), and `SlotMap`, catalog slot -> the order's local slot. Included once, by that
 * file (its only translation unit). */
#ifndef KVTIER_NATIVE_TABLES_H
#define KVTIER_NATIVE_TABLES_H

/* ---- arrays in anonymous mappings ------------------------------------------------- */

typedef struct {
    void *p;
    size_t cap_bytes;
} Mapped;

static int mapped_reserve(Mapped *m, size_t need_bytes)
{
    if (need_bytes <= m->cap_bytes)
        return 0;
    size_t want = m->cap_bytes + (m->cap_bytes >> 3);
    if (want < need_bytes)
        want = need_bytes;
    size_t page = 4096;
    want = (want + page - 1) & ~(page - 1);
    void *p;
    if (m->p == NULL)
        p = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    else
        p = mremap(m->p, m->cap_bytes, want, MREMAP_MAYMOVE);
    if (p == MAP_FAILED) {
        PyErr_NoMemory();
        return -1;
    }
    m->p = p;
    m->cap_bytes = want;
    return 0;
}

static void mapped_free(Mapped *m)
{
    if (m->p != NULL)
        munmap(m->p, m->cap_bytes);
    m->p = NULL;
    m->cap_bytes = 0;
}

static inline uint64_t mix64(uint64_t x)
{
    /* the index's position from any 64-bit key (slots are small consecutive ints) */
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

/* ---- DigestSet: an ordered set of 64-bit digests (DigestTable with values 0) ------- */
/* Node 0 is the order's sentinel (its next: the oldest). The index holds node numbers
 * (0: empty), linear probing, at most 0.7 full, backward-shift deletion. */

typedef struct {
    uint64_t digest;
    int32_t prev, next;
} DNode;

typedef struct {
    Mapped nodes; /* DNode[] */
    Mapped index; /* int32_t[] */
    int32_t nodes_made;
    int32_t free_node; /* chained through next; 0: none */
    uint32_t mask;
    Py_ssize_t len;
} DigestSet;

#define DN(s) ((DNode *)(s)->nodes.p)
#define DI(s) ((int32_t *)(s)->index.p)

static int dset_init(DigestSet *s)
{
    memset(s, 0, sizeof(*s));
    if (mapped_reserve(&s->nodes, 16 * sizeof(DNode)) < 0)
        return -1;
    if (mapped_reserve(&s->index, 16 * sizeof(int32_t)) < 0)
        return -1;
    s->mask = 15;
    s->nodes_made = 1;
    DN(s)[0].prev = DN(s)[0].next = 0;
    return 0;
}

static void dset_free(DigestSet *s)
{
    mapped_free(&s->nodes);
    mapped_free(&s->index);
}

static inline uint32_t dset_home(const DigestSet *s, uint64_t digest)
{
    return (uint32_t)mix64(digest) & s->mask;
}

/* index position holding `digest`, or -1 */
static Py_ssize_t dset_find(const DigestSet *s, uint64_t digest)
{
    const int32_t *index = DI(s);
    const DNode *nodes = DN(s);
    uint32_t i = dset_home(s, digest);
    for (;;) {
        int32_t node = index[i];
        if (node == 0)
            return -1;
        if (nodes[node].digest == digest)
            return i;
        i = (i + 1) & s->mask;
    }
}

static inline void dn_unlink(DNode *nodes, int32_t node)
{
    int32_t before = nodes[node].prev, after = nodes[node].next;
    nodes[before].next = after;
    nodes[after].prev = before;
}

static inline void dn_link_last(DNode *nodes, int32_t node)
{
    int32_t last = nodes[0].prev;
    nodes[node].prev = last;
    nodes[node].next = 0;
    nodes[last].next = node;
    nodes[0].prev = node;
}

static void dset_place(DigestSet *s, int32_t node)
{
    int32_t *index = DI(s);
    uint32_t i = dset_home(s, DN(s)[node].digest);
    while (index[i] != 0)
        i = (i + 1) & s->mask;
    index[i] = node;
}

static int dset_grow_index(DigestSet *s)
{
    size_t size = (size_t)s->mask + 1;
    Mapped fresh = {NULL, 0};
    if (mapped_reserve(&fresh, 2 * size * sizeof(int32_t)) < 0)
        return -1;
    mapped_free(&s->index);
    s->index = fresh;
    s->mask = (uint32_t)(2 * size - 1);
    DNode *nodes = DN(s);
    for (int32_t node = nodes[0].next; node != 0; node = nodes[node].next)
        dset_place(s, node);
    return 0;
}

/* add a digest known to be absent, at the end */
static int dset_add(DigestSet *s, uint64_t digest)
{
    if ((size_t)(s->len + 1) * 10 > (size_t)7 * (s->mask + 1)) {
        if (dset_grow_index(s) < 0)
            return -1;
    }
    int32_t node = s->free_node;
    if (node) {
        s->free_node = DN(s)[node].next;
    } else {
        if (s->nodes_made == INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "digest table full");
            return -1;
        }
        node = s->nodes_made;
        if (mapped_reserve(&s->nodes, ((size_t)node + 1) * sizeof(DNode)) < 0)
            return -1;
        s->nodes_made++;
    }
    DNode *nodes = DN(s);
    nodes[node].digest = digest;
    dn_link_last(nodes, node);
    dset_place(s, node);
    s->len++;
    return 0;
}

static void dset_drop(DigestSet *s, Py_ssize_t at)
{
    int32_t *index = DI(s);
    DNode *nodes = DN(s);
    uint32_t mask = s->mask;
    uint32_t hole = (uint32_t)at, j = (uint32_t)at;
    int32_t node = index[at];
    for (;;) {
        j = (j + 1) & mask;
        int32_t moved = index[j];
        if (moved == 0)
            break;
        uint32_t home = dset_home(s, nodes[moved].digest);
        if ((home <= hole && hole < j) || (hole < j && j < home) || (j < home && home <= hole)) {
            index[hole] = moved;
            hole = j;
        }
    }
    index[hole] = 0;
    s->len--;
    dn_unlink(nodes, node);
    nodes[node].next = s->free_node;
    s->free_node = node;
}

/* DigestTable.exchange: whether it was present; it is last after */
static int dset_exchange(DigestSet *s, uint64_t digest)
{
    Py_ssize_t at = dset_find(s, digest);
    if (at < 0)
        return dset_add(s, digest) < 0 ? -1 : 0;
    DNode *nodes = DN(s);
    int32_t node = DI(s)[at];
    dn_unlink(nodes, node);
    dn_link_last(nodes, node);
    return 1;
}

/* DigestTable.pop: whether it was present */
static int dset_pop(DigestSet *s, uint64_t digest)
{
    Py_ssize_t at = dset_find(s, digest);
    if (at < 0)
        return 0;
    dset_drop(s, at);
    return 1;
}

static void dset_trim(DigestSet *s, Py_ssize_t most)
{
    while (s->len > most)
        dset_drop(s, dset_find(s, DN(s)[DN(s)[0].next].digest));
}

/* ---- SlotMap: catalog slot -> local slot -------------------------------------------- */

typedef struct {
    int64_t key; /* -1: empty */
    int32_t value;
    int32_t pad;
} SEntry;

typedef struct {
    Mapped entries; /* SEntry[] */
    uint32_t mask;
    Py_ssize_t len;
} SlotMap;

#define SE(m) ((SEntry *)(m)->entries.p)

static int smap_alloc(SlotMap *m, size_t size)
{
    if (mapped_reserve(&m->entries, size * sizeof(SEntry)) < 0)
        return -1;
    SEntry *e = SE(m);
    for (size_t i = 0; i < size; i++)
        e[i].key = -1;
    m->mask = (uint32_t)(size - 1);
    return 0;
}

static int smap_init(SlotMap *m)
{
    memset(m, 0, sizeof(*m));
    return smap_alloc(m, 16);
}

static inline uint32_t smap_home(const SlotMap *m, int64_t key)
{
    return (uint32_t)mix64((uint64_t)key) & m->mask;
}

static int32_t smap_get(const SlotMap *m, int64_t key)
{
    const SEntry *e = SE(m);
    uint32_t i = smap_home(m, key);
    for (;;) {
        if (e[i].key == key)
            return e[i].value;
        if (e[i].key < 0)
            return NONE;
        i = (i + 1) & m->mask;
    }
}

static void smap_place(SlotMap *m, int64_t key, int32_t value)
{
    SEntry *e = SE(m);
    uint32_t i = smap_home(m, key);
    while (e[i].key >= 0)
        i = (i + 1) & m->mask;
    e[i].key = key;
    e[i].value = value;
}

/* add a key known to be absent */
static int smap_add(SlotMap *m, int64_t key, int32_t value)
{
    if ((size_t)(m->len + 1) * 10 > (size_t)7 * (m->mask + 1)) {
        size_t size = (size_t)m->mask + 1;
        SlotMap bigger;
        memset(&bigger, 0, sizeof(bigger));
        if (smap_alloc(&bigger, 2 * size) < 0)
            return -1;
        SEntry *old = SE(m);
        for (size_t i = 0; i < size; i++)
            if (old[i].key >= 0)
                smap_place(&bigger, old[i].key, old[i].value);
        bigger.len = m->len;
        mapped_free(&m->entries);
        *m = bigger;
    }
    smap_place(m, key, value);
    m->len++;
    return 0;
}

static void smap_del(SlotMap *m, int64_t key)
{
    SEntry *e = SE(m);
    uint32_t mask = m->mask;
    uint32_t hole = smap_home(m, key);
    while (e[hole].key != key) {
        if (e[hole].key < 0)
            return;
        hole = (hole + 1) & mask;
    }
    uint32_t j = hole;
    for (;;) {
        j = (j + 1) & mask;
        if (e[j].key < 0)
            break;
        uint32_t home = smap_home(m, e[j].key);
        if ((home <= hole && hole < j) || (hole < j && j < home) || (j < home && home <= hole)) {
            e[hole] = e[j];
            hole = j;
        }
    }
    e[hole].key = -1;
    m->len--;
}

#endif /* KVTIER_NATIVE_TABLES_H */
