/* heap.h: handing memory the C heap holds but no longer uses back to the operating system.
 * Not for: the tensors' own memory (torch's allocator) or shared-memory segments (shm/). */
#ifndef ACC_HEAP_H
#define ACC_HEAP_H

/* Returns 1 when the allocator released memory, 0 when there was none to release, -1 when this C library has no
 * such call (musl, for one, unmaps large freed blocks itself). */
int acc_heap_trim(void);

#endif
