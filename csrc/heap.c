/* heap.c: acc_heap_trim and acc_heap_mmap_threshold (heap.h). glibc keeps freed blocks below its mmap threshold
 * (which grows to 32 MiB as large blocks are freed) in its arenas for reuse, so the full-size tensors a sharded
 * prepare or the first optimizer step frees stay in the process; malloc_trim(0) returns the free pages of every arena (madvise on
 * whole free pages, top chunks shrunk). A fixed mmap threshold keeps large blocks out of the heap altogether, so a
 * training step's freed temporaries can neither stay resident in it nor fragment it. Elsewhere there is nothing
 * to call.
 * Not for: deciding when (accelerate_c/runtime/memory.py). */
#include "heap.h"

#include <limits.h>
#include <stdlib.h> /* (defines __GLIBC__ where it is glibc) */

#if defined(__GLIBC__)
#include <malloc.h>
#endif

int acc_heap_trim(void) {
#if defined(__GLIBC__)
    return malloc_trim(0) ? 1 : 0;
#else
    return -1;
#endif
}

int acc_heap_mmap_threshold(unsigned long bytes) {
#if defined(__GLIBC__)
    if (bytes > (unsigned long)INT_MAX) return 0;
    return mallopt(M_MMAP_THRESHOLD, (int)bytes) ? 1 : 0;
#else
    (void)bytes;
    return -1;
#endif
}
