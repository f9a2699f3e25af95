/* p2p.h: point-to-point channels between the ranks of one host, for pipeline stages (activations forward,
 * gradients back). Not for: collectives (shm.h), ranks on other hosts (torch.distributed's isend/irecv do that).
 *
 * A channel is a single-producer / single-consumer ring of `nslots` slots of `slot_bytes` each, living in the
 * receiver's part of a shared region that the caller allocated collectively (ShmGroup.alloc: part r belongs to
 * rank r); a message of any size streams through it in chunks, each slot carrying (tag, message bytes, offset,
 * length) so the receiver checks that the message is the one it posted. Part r begins with a doorbell block
 * (P2P_BELL_BYTES): rank r's progress thread sleeps on that futex word, and whoever publishes a chunk for it (a
 * sender) or frees a slot of its (a receiver) rings it.
 *
 * Requests are asynchronous: acc_p2p_post queues a send or a receive on a ring and returns a ticket; one progress
 * thread per process (started on the first post) moves the chunks without the GIL, so a send overlaps compute and
 * a receive posted ahead lands while the caller computes; acc_p2p_wait blocks until the ticket finished. Requests
 * on one ring complete in the order they were posted (FIFO, both ends). Errors follow the group's conventions: a
 * request that sees no progress for the group's timeout, a dead peer (its pid in the group's slots) or the group's
 * abort flag fails with a message naming the ring, the peer and the tag, and every later request fails with the
 * first error; a timeout or a dead peer also aborts the group, so every rank's collectives and channels stop. */
#ifndef ACC_P2P_H
#define ACC_P2P_H

#include <stddef.h>
#include <stdint.h>

#include "acc.h"
#include "shm.h"

#define ACC_P2P_BELL_BYTES 4096

typedef struct acc_p2p acc_p2p;

/* Bytes a ring takes in its receiver's part (a multiple of 64); slot_bytes must be a positive multiple of 64. */
size_t acc_p2p_ring_bytes(uint32_t nslots, size_t slot_bytes);
/* Opens this rank's view of `nrings` rings: ring i carries src[i] -> dst[i] and lives at base + dst[i] * part_bytes
 * + off[i] (off[i] >= ACC_P2P_BELL_BYTES). The region must be zeroed when the first rank opens it; every rank opens
 * the same table. The group must outlive the p2p object (close it first). */
acc_status acc_p2p_open(acc_shm_group *g, char *base, size_t part_bytes, int nrings, const int32_t *src,
                        const int32_t *dst, const uint64_t *off, uint32_t nslots, size_t slot_bytes, acc_p2p **out);
/* Stops the progress thread (pending requests fail) and frees the object. Safe on NULL. */
void acc_p2p_close(acc_p2p *p);
/* Queues a send (this rank must be the ring's source) or a receive (its destination) of data[0:nbytes) with `tag`;
 * the caller keeps the buffer alive and untouched until the ticket finished. */
acc_status acc_p2p_post(acc_p2p *p, int ring, int send, void *data, size_t nbytes, uint64_t tag, uint64_t *ticket);
/* Blocks until the ticket finished; its status (the error text is set on failure). */
acc_status acc_p2p_wait(acc_p2p *p, uint64_t ticket);
int acc_p2p_done(acc_p2p *p, uint64_t ticket);
/* Aborts the group with `msg` (every rank's waits fail naming this rank) and wakes every progress thread. */
void acc_p2p_abort(acc_p2p *p, const char *msg);

#endif
