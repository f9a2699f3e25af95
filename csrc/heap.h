/* heap.h: handing memory the C heap holds but no longer uses back to the operating system.
 * Not for: the tensors' own memory (torch's allocator) or shared-memory segments (shm/). */
#ifndef ACC_HEAP_H
#define ACC_HEAP_H

/* Returns 1 when the allocator released memory, 0 when there was none to release, -1 when this C library has no
 * such call (musl, for one, unmaps large freed blocks itself). */
int acc_heap_trim(void);

/* Fixes the size from which the allocator serves a block from a mapping of its own (given back to the system when
 * freed) instead of its heap, turning off glibc's habit of raising that threshold (up to 32 MiB) each time such a
 * block is freed. Returns 1 when set, 0 when the allocator refused the value, -1 when this C library has no such
 * setting. */
int acc_heap_mmap_threshold(unsigned long bytes);

#endif
