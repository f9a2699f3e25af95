/* options.h: the process-wide run-time options of the C core. C never reads the environment: Python passes the
 * values in (_C.set_options, module.c; the settings come from accelerate_c's Python side), the compute code reads
 * them here. Not for: the SIMD level (cpu.h, _C.simd_level) or anything that is a per-call argument.
 *   cast_thp           ask for transparent huge pages on large fresh cast outputs (ops/cast.c); default off
 *   openmp_pool        run the kernels' chunks on the OpenMP pool torch loaded (parallel.c); default on
 *   shm_spin_us        spin budget of a shm wait at the first arrival of a call (shm/shm_seg.c); default 50
 *   shm_inner_spin_us  the same between the phases of one call; default 1000
 * A shm group takes the spin values current when it is opened. Reads and writes are atomic (relaxed): a kernel
 * running on another thread sees either the old or the new value. */
#ifndef ACC_OPTIONS_H
#define ACC_OPTIONS_H

#define ACC_OPT_SPIN_MAX_US 10000000L /* 10 s: the bound _C.set_options enforces on both spin times */

typedef struct {
    int cast_thp, openmp_pool;
    long shm_spin_us, shm_inner_spin_us;
} acc_options;

void acc_options_get(acc_options *out);
void acc_options_set(const acc_options *o); /* the caller has checked the bounds */
int acc_options_cast_thp(void);
int acc_options_openmp_pool(void);

#endif
