/* options.c: storage of the run-time options (see options.h). Not for: parsing or validation (module.c). */
#include <stdatomic.h>

#include "options.h"

static atomic_int g_cast_thp = 0, g_openmp_pool = 1;
static atomic_long g_shm_spin_us = 50, g_shm_inner_spin_us = 1000;

void acc_options_get(acc_options *out) {
    out->cast_thp = atomic_load_explicit(&g_cast_thp, memory_order_relaxed);
    out->openmp_pool = atomic_load_explicit(&g_openmp_pool, memory_order_relaxed);
    out->shm_spin_us = atomic_load_explicit(&g_shm_spin_us, memory_order_relaxed);
    out->shm_inner_spin_us = atomic_load_explicit(&g_shm_inner_spin_us, memory_order_relaxed);
}

void acc_options_set(const acc_options *o) {
    atomic_store_explicit(&g_cast_thp, o->cast_thp, memory_order_relaxed);
    atomic_store_explicit(&g_openmp_pool, o->openmp_pool, memory_order_relaxed);
    atomic_store_explicit(&g_shm_spin_us, o->shm_spin_us, memory_order_relaxed);
    atomic_store_explicit(&g_shm_inner_spin_us, o->shm_inner_spin_us, memory_order_relaxed);
}

int acc_options_cast_thp(void) { return atomic_load_explicit(&g_cast_thp, memory_order_relaxed); }

int acc_options_openmp_pool(void) { return atomic_load_explicit(&g_openmp_pool, memory_order_relaxed); }
