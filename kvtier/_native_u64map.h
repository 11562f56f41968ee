/* A u64 -> u64 hash table for kvtier's C extensions (kvtier/tiers/_alloc_native.c,
 * kvtier/engine/_directory_native.c): linear probing, at most half full, backward-shift
 * deletion, in the Python allocator's memory (PyMem_*). Each including file is its own
 * translation unit, so everything here is static. */
#ifndef KVTIER_NATIVE_U64MAP_H
#define KVTIER_NATIVE_U64MAP_H

#include <stdint.h>

typedef struct {
    uint64_t *keys; /* key + 1; 0: empty */
    uint64_t *vals;
    size_t mask;
    size_t len;
} U64Map;

/* where a probe for `key` starts (any 64-bit key: offsets, hashes) */
static inline size_t home_of(uint64_t key, size_t mask)
{
    uint64_t x = key;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x & mask;
}

/* backward-shift deletion: with a hole at `i`, whether the entry at `j` (later in the
 * same probe run) whose probe starts at `home` must stay, its home lying cyclically in
 * (i, j]; else it moves into the hole */
static inline int stays_after_hole(size_t i, size_t j, size_t home)
{
    return (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
}

static int map_init(U64Map *m, size_t slots)
{
    m->keys = PyMem_Calloc(slots, sizeof(uint64_t));
    m->vals = PyMem_Calloc(slots, sizeof(uint64_t));
    if (m->keys == NULL || m->vals == NULL) {
        PyMem_Free(m->keys);
        PyMem_Free(m->vals);
        m->keys = m->vals = NULL;
        PyErr_NoMemory();
        return -1;
    }
    m->mask = slots - 1;
    m->len = 0;
    return 0;
}

static void map_free(U64Map *m)
{
    PyMem_Free(m->keys);
    PyMem_Free(m->vals);
    m->keys = m->vals = NULL;
}

/* the position of `key`, or of the empty entry where it would go */
static inline size_t map_pos(const U64Map *m, uint64_t key)
{
    size_t i = home_of(key, m->mask);
    while (m->keys[i] != 0 && m->keys[i] != key + 1)
        i = (i + 1) & m->mask;
    return i;
}

static inline int map_get(const U64Map *m, uint64_t key, uint64_t *val)
{
    size_t i = map_pos(m, key);
    if (m->keys[i] == 0)
        return 0;
    *val = m->vals[i];
    return 1;
}

static int map_put(U64Map *m, uint64_t key, uint64_t val)
{
    if (2 * (m->len + 1) > m->mask + 1) { /* keep it at most half full: rehash into twice */
        U64Map grown;
        if (map_init(&grown, 2 * (m->mask + 1)) < 0)
            return -1;
        for (size_t i = 0; i <= m->mask; i++)
            if (m->keys[i] != 0) {
                size_t j = map_pos(&grown, m->keys[i] - 1);
                grown.keys[j] = m->keys[i];
                grown.vals[j] = m->vals[i];
            }
        grown.len = m->len;
        map_free(m);
        *m = grown;
    }
    size_t i = map_pos(m, key);
    if (m->keys[i] == 0) {
        m->keys[i] = key + 1;
        m->len++;
    }
    m->vals[i] = val;
    return 0;
}

static void map_del(U64Map *m, uint64_t key)
{
    size_t i = map_pos(m, key);
    if (m->keys[i] == 0)
        return;
    /* backward shift: pull later entries of the run into the hole where their probe
     * passes it, so lookups never meet a hole before their key */
    size_t j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        if (m->keys[j] == 0)
            break;
        if (!stays_after_hole(i, j, home_of(m->keys[j] - 1, m->mask))) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->keys[i] = 0;
    m->len--;
}

#endif
