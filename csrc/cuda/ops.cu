/* cuda/ops.cu: the element-wise and reduction kernels of accelerate_c._C_cuda (kernels.h), in CUDA C:
 *   multi-copy   many (src, dst) conversions in one launch (the sharded engine's copy-in and copy-out);
 *   cast         one tensor, scale and float8 saturation, amax from the same pass (cast.h's semantics; bf16/fp16
 *                outputs with the device's NaN, as torch's CUDA conversions);
 *   multi-scale  the non-finite check + unscale (GradScaler's) or the clip coefficient, factor from device memory;
 *   nonfinite    the optimizer's pre-check of scaled gradients into a device flag (no host read);
 *   norm         the global norm in fp64, per-block partial sums then one block summing them in a fixed order
 *                (deterministic for a given plan).
 * Amax and the non-finite flag are combined with order-independent operations (a maximum of ordered keys, a store
 * of 1), so their results never depend on the schedule. The thread functions are ACC_HD and the emulation below
 * runs the plans on the CPU (tests).
 * Not for: the optimizers (optim.cu), Python. */
#include <math.h>
#include <stdlib.h>

#include "cuda/cuda_common.h"

#define CAST_GRID_MAX 4096u /* the cast's grid-stride loop: enough blocks to fill a GPU, few amax atomics */

/* ---- multi-tensor element-wise passes: copy, scale, non-finite check -------------------------------------- */

typedef struct {
    const void *src;
    void *dst;
    uint64_t n;
    int sdt, ddt;
} copy_item;

typedef struct {
    void *data;
    uint64_t n;
    int dt;
} buf_item;

typedef struct {
    mt_plan plan;
    int op;                         /* 0 copy, 1 scale (+ check), 2 non-finite check */
    copy_item cp[ACC_CU_MT];        /* op 0 */
    buf_item bf[ACC_CU_MT];         /* ops 1, 2 */
    float factor;                   /* op 1: the factor (unless factor_dev); op 2: the scale */
    const float *factor_dev;
    float *flag;                    /* op 1: found_inf (may be NULL); op 2: the non-finite flag */
} ew_launch;

static inline ACC_HD float ld1(const void *a, int dt, uint64_t i) { return acc_load_elem(a, (acc_dtype)dt, i); }

static inline ACC_HD void st1(void *a, int dt, uint64_t i, float x) {
    if (dt == ACC_F32) ((float *)a)[i] = x;
    else ((uint16_t *)a)[i] = cu_to16(x, (acc_dtype)dt);
}

static inline ACC_HD void ew_thread(const ew_launch *L, int t, uint32_t blk, uint32_t tid, uint32_t nthr) {
    const uint64_t lo = (uint64_t)blk * ACC_CU_CHUNK;
    if (L->op == 0) {
        const copy_item *c = &L->cp[t];
        const uint64_t hi = cu_min64(lo + ACC_CU_CHUNK, c->n);
        for (uint64_t i = lo + tid; i < hi; i += nthr) {
            if (c->sdt == c->ddt && c->sdt == ACC_F32) ((float *)c->dst)[i] = ((const float *)c->src)[i];
            else if (c->sdt == c->ddt) ((uint16_t *)c->dst)[i] = ((const uint16_t *)c->src)[i]; /* the bits as they are */
            else st1(c->dst, c->ddt, i, ld1(c->src, c->sdt, i));
        }
        return;
    }
    const buf_item *b = &L->bf[t];
    const uint64_t hi = cu_min64(lo + ACC_CU_CHUNK, b->n);
    const float f = L->factor_dev ? *L->factor_dev : L->factor;
    int bad = 0;
    for (uint64_t i = lo + tid; i < hi; i += nthr) {
        const float x = ld1(b->data, b->dt, i);
        if (L->op == 2) {
            bad |= !isfinite(x * f);
            continue;
        }
        bad |= !isfinite(x);
        if (f != 1.0f) st1(b->data, b->dt, i, x * f);
    }
    if (bad && L->flag) *L->flag = 1.0f; /* every writer stores the same value */
}

__global__ void __launch_bounds__(ACC_CU_THREADS) k_elementwise(const ew_launch L) {
    const int t = mt_find(&L.plan, blockIdx.x);
    ew_thread(&L, t, blockIdx.x - L.plan.first[t], threadIdx.x, blockDim.x);
}

static acc_status ew_run(ew_launch *L, uint32_t blocks, void *stream, int emulate) {
    L->plan.first[L->plan.k] = blocks;
    if (!blocks) return ACC_OK;
    if (!emulate) {
        k_elementwise<<<blocks, ACC_CU_THREADS, 0, (cudaStream_t)stream>>>(*L);
        return cu_check(L->op == 0 ? "multi_copy" : L->op == 1 ? "multi_scale_" : "nonfinite");
    }
    for (uint32_t b = 0; b < blocks; b++) {
        const int t = mt_find(&L->plan, b);
        for (uint32_t tid = 0; tid < ACC_CU_THREADS; tid++) ew_thread(L, t, b - L->plan.first[t], tid, ACC_CU_THREADS);
    }
    return ACC_OK;
}

/* one plan over n[] element counts: launches of up to ACC_CU_MT tensors; fill(L, slot, k) puts tensor k in a slot */
typedef void (*ew_fill)(ew_launch *L, int slot, size_t k, const void *items);

static acc_status ew_plan(ew_launch *L, const void *items, size_t count, const uint64_t *(*count_of)(const void *,
                          size_t), ew_fill fill, void *stream, int emulate) {
    acc_status st = ACC_OK;
    uint32_t blocks = 0;
    L->plan.k = 0;
    for (size_t k = 0; k < count && st == ACC_OK; k++) {
        const uint64_t n = *count_of(items, k);
        const uint32_t nb = (uint32_t)((n + ACC_CU_CHUNK - 1) / ACC_CU_CHUNK);
        if (L->plan.k == ACC_CU_MT || (uint64_t)blocks + nb > ACC_CU_MAX_GRID) {
            st = ew_run(L, blocks, stream, emulate);
            L->plan.k = 0, blocks = 0;
        }
        L->plan.first[L->plan.k] = blocks;
        fill(L, L->plan.k++, k, items);
        blocks += nb;
    }
    return st == ACC_OK ? ew_run(L, blocks, stream, emulate) : st;
}

static const uint64_t *copy_count(const void *items, size_t k) { return &((const acc_cuda_copy *)items)[k].n; }
static const uint64_t *buf_count(const void *items, size_t k) { return &((const acc_cuda_buf *)items)[k].n; }

static void copy_fill(ew_launch *L, int slot, size_t k, const void *items) {
    const acc_cuda_copy *c = &((const acc_cuda_copy *)items)[k];
    copy_item *d = &L->cp[slot];
    d->src = c->src, d->dst = c->dst, d->n = c->n, d->sdt = c->src_dtype, d->ddt = c->dst_dtype;
}

static void buf_fill(ew_launch *L, int slot, size_t k, const void *items) {
    const acc_cuda_buf *c = &((const acc_cuda_buf *)items)[k];
    buf_item *d = &L->bf[slot];
    d->data = c->data, d->n = c->n, d->dt = c->dtype;
}

static acc_status check_float(acc_dtype dt, size_t k, const char *what) {
    if (dt == ACC_F32 || dt == ACC_BF16 || dt == ACC_F16) return ACC_OK;
    acc_set_error("%s %zu: dtype %s not supported (float32, bfloat16, float16)", what, k, acc_dtype_name(dt));
    return ACC_ERR_DTYPE;
}

static acc_status multi_copy(const acc_cuda_copy *cs, size_t nc, void *stream, int emulate) {
    for (size_t k = 0; k < nc; k++) {
        acc_status st = check_float(cs[k].src_dtype, k, "copy");
        if (!st) st = check_float(cs[k].dst_dtype, k, "copy");
        if (st) return st;
    }
    ew_launch *L = (ew_launch *)calloc(1, sizeof(ew_launch));
    if (!L) return ACC_ERR_NOMEM;
    L->op = 0;
    acc_status st = ew_plan(L, cs, nc, copy_count, copy_fill, stream, emulate);
    free(L);
    return st;
}

static acc_status multi_bufs(int op, const acc_cuda_buf *bufs, size_t nb, float factor, const float *factor_dev,
                             float *flag, void *stream, int emulate) {
    for (size_t k = 0; k < nb; k++) {
        acc_status st = check_float(bufs[k].dtype, k, "buffer");
        if (st) return st;
    }
    if (op == 2 && !emulate) {
        if (cudaMemsetAsync(flag, 0, sizeof(float), (cudaStream_t)stream) != cudaSuccess) return cu_check("nonfinite");
    } else if (op == 2) {
        *flag = 0.0f;
    }
    ew_launch *L = (ew_launch *)calloc(1, sizeof(ew_launch));
    if (!L) return ACC_ERR_NOMEM;
    L->op = op, L->factor = factor, L->factor_dev = factor_dev, L->flag = flag;
    acc_status st = ew_plan(L, bufs, nb, buf_count, buf_fill, stream, emulate);
    free(L);
    return st;
}

extern "C" acc_status acc_cuda_multi_copy(const acc_cuda_copy *cs, size_t nc, void *stream) {
    return multi_copy(cs, nc, stream, 0);
}

extern "C" acc_status acc_cuda_emulate_multi_copy(const acc_cuda_copy *cs, size_t nc) {
    return multi_copy(cs, nc, NULL, 1);
}

extern "C" acc_status acc_cuda_multi_scale(const acc_cuda_buf *bufs, size_t nb, float factor, const float *factor_dev,
                                           float *found_inf, void *stream) {
    return multi_bufs(1, bufs, nb, factor, factor_dev, found_inf, stream, 0);
}

extern "C" acc_status acc_cuda_emulate_multi_scale(const acc_cuda_buf *bufs, size_t nb, float factor,
                                                   float *found_inf) {
    return multi_bufs(1, bufs, nb, factor, NULL, found_inf, NULL, 1);
}

extern "C" acc_status acc_cuda_nonfinite(const acc_cuda_buf *bufs, size_t nb, float scale, float *flag, void *stream) {
    return multi_bufs(2, bufs, nb, scale, NULL, flag, stream, 0);
}

extern "C" acc_status acc_cuda_emulate_nonfinite(const acc_cuda_buf *bufs, size_t nb, float scale, float *flag) {
    return multi_bufs(2, bufs, nb, scale, NULL, flag, NULL, 1);
}

/* ---- cast with scale and amax ------------------------------------------------------------------------------- */

typedef struct {
    const void *src;
    void *dst;
    uint64_t n;
    const float *scale;             /* device scalar, or NULL */
    float scale_val;                /* the host's scale when has_scale and no device scalar */
    int has_scale;
    unsigned int *amax;             /* the amax's bits, as an ordered key (cu_amax_key) */
    int sdt, ddt, vec4;
} cast_args;

static inline ACC_HD void cast_store(const cast_args *a, uint64_t i, float x) {
    switch (a->ddt) {
    case ACC_F32: ((float *)a->dst)[i] = x; break;
    case ACC_BF16: case ACC_F16: ((uint16_t *)a->dst)[i] = cu_to16(x, (acc_dtype)a->ddt); break;
    case ACC_E4M3: ((uint8_t *)a->dst)[i] = acc_f32_to_e4m3(x); break;
    default: ((uint8_t *)a->dst)[i] = acc_f32_to_e5m2(x); break;
    }
}

/* 4 converted elements 4q .. 4q+3 in one store (16, 8 or 4 bytes; the destination is aligned when vec4) */
static inline ACC_HD void cast_store4(const cast_args *a, uint64_t q, const float y[4]) {
    switch (a->ddt) {
    case ACC_F32: st4f32((float *)a->dst, q, y); break;
    case ACC_BF16: case ACC_F16: {
#ifdef ACC_CU_HW16
        ((uint2 *)a->dst)[q] = cu_hw16x4(y, a->ddt == ACC_BF16);
#else
        uint16_t u[4];
        for (int j = 0; j < 4; j++) u[j] = cu_to16(y[j], (acc_dtype)a->ddt);
        st4u16(a->dst, q, u);
#endif
        break;
    }
    default: {
#ifdef ACC_CU_HW8
        ((uint32_t *)a->dst)[q] = cu_hw8x4(y, a->ddt == ACC_E4M3);
#else
        uint8_t u[4];
        for (int j = 0; j < 4; j++) u[j] = a->ddt == ACC_E4M3 ? acc_f32_to_e4m3(y[j]) : acc_f32_to_e5m2(y[j]);
        uchar4 b;
        b.x = u[0], b.y = u[1], b.z = u[2], b.w = u[3];
        ((uchar4 *)a->dst)[q] = b;
#endif
    }
    }
}

#define CAST_UNROLL 4 /* groups of 4 a thread loads before it converts and stores: more bytes in flight */

/* global thread g of `stride` threads: its elements (CAST_UNROLL groups of 4 per pass where aligned, every load of
 * a pass before its stores), returns the largest amax key */
static inline ACC_HD uint32_t cast_thread(const cast_args *a, uint64_t g, uint64_t stride) {
    uint32_t key = 0;
    const float s = a->scale ? *a->scale : a->scale_val;
    uint64_t i0 = 0;
    if (a->vec4) {
        const uint64_t nq = a->n / 4;
        for (uint64_t q0 = g; q0 < nq; q0 += CAST_UNROLL * stride) {
            float x[CAST_UNROLL][4];
            for (int u = 0; u < CAST_UNROLL; u++)
                if (q0 + u * stride < nq) ld4f(a->src, (acc_dtype)a->sdt, q0 + u * stride, x[u]);
            for (int u = 0; u < CAST_UNROLL; u++) {
                if (q0 + u * stride >= nq) break;
                for (int j = 0; j < 4; j++) {
                    uint32_t k = cu_amax_key(x[u][j]);
                    key = k > key ? k : key;
                    if (a->has_scale) x[u][j] *= s;
                }
                cast_store4(a, q0 + u * stride, x[u]);
            }
        }
        i0 = nq * 4;
    }
    for (uint64_t i = i0 + g; i < a->n; i += stride) {
        const float x = acc_load_elem(a->src, (acc_dtype)a->sdt, i);
        uint32_t k = cu_amax_key(x);
        key = k > key ? k : key;
        cast_store(a, i, a->has_scale ? x * s : x);
    }
    return key;
}

__global__ void __launch_bounds__(ACC_CU_THREADS) k_cast(const cast_args a) {
    __shared__ uint32_t keys[ACC_CU_THREADS / 32];
    uint32_t key = cast_thread(&a, (uint64_t)blockIdx.x * blockDim.x + threadIdx.x, (uint64_t)gridDim.x * blockDim.x);
    if (!a.amax) return;
    for (int off = 16; off; off >>= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, off));
    if ((threadIdx.x & 31) == 0) keys[threadIdx.x >> 5] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ACC_CU_THREADS / 32; w++) key = max(key, keys[w]);
        if (key) atomicMax(a.amax, key);
    }
}

static acc_status cast(const void *src, acc_dtype sdt, void *dst, acc_dtype ddt, size_t n, const float *scale,
                       const float *scale_host, float *amax_out, void *stream, int emulate) {
    acc_status st = check_float(sdt, 0, "cast input");
    if (st) return st;
    if (ddt != ACC_F32 && ddt != ACC_BF16 && ddt != ACC_F16 && ddt != ACC_E4M3 && ddt != ACC_E5M2) {
        acc_set_error("cast: unsupported output dtype %s", acc_dtype_name(ddt));
        return ACC_ERR_DTYPE;
    }
    cast_args a;
    memset(&a, 0, sizeof a);
    a.src = src, a.dst = dst, a.n = n, a.scale = scale, a.amax = (unsigned int *)amax_out, a.sdt = sdt, a.ddt = ddt;
    a.has_scale = scale != NULL || scale_host != NULL, a.scale_val = scale_host ? *scale_host : 1.0f;
    a.vec4 = cu_aligned(src, sdt == ACC_F32 ? 16 : 8) && cu_aligned(dst, (unsigned)(4 * acc_dtype_size(ddt)));
    const uint64_t work = a.vec4 ? (n + 4 * CAST_UNROLL - 1) / (4 * CAST_UNROLL) : n;
    uint64_t blocks = (work + ACC_CU_THREADS - 1) / ACC_CU_THREADS;
    blocks = blocks < CAST_GRID_MAX ? blocks : CAST_GRID_MAX;
    if (emulate) {
        uint32_t key = 0;
        for (uint64_t g = 0; g < blocks * ACC_CU_THREADS; g++) {
            uint32_t k = cast_thread(&a, g, blocks * ACC_CU_THREADS);
            key = k > key ? k : key;
        }
        if (amax_out) *(uint32_t *)amax_out = key;
        return ACC_OK;
    }
    if (amax_out && cudaMemsetAsync(amax_out, 0, sizeof(float), (cudaStream_t)stream) != cudaSuccess)
        return cu_check("cast");
    if (blocks) k_cast<<<(unsigned)blocks, ACC_CU_THREADS, 0, (cudaStream_t)stream>>>(a);
    return cu_check("cast");
}

extern "C" acc_status acc_cuda_cast(const void *src, acc_dtype src_dtype, void *dst, acc_dtype dst_dtype, size_t n,
                                    const float *scale_dev, const float *scale_host, float *amax_out, void *stream) {
    return cast(src, src_dtype, dst, dst_dtype, n, scale_dev, scale_host, amax_out, stream, 0);
}

extern "C" acc_status acc_cuda_emulate_cast(const void *src, acc_dtype src_dtype, void *dst, acc_dtype dst_dtype,
                                            size_t n, const float *scale, float *amax_out) {
    return cast(src, src_dtype, dst, dst_dtype, n, NULL, scale, amax_out, NULL, 1);
}

/* ---- global norm ----------------------------------------------------------------------------------------------- */

typedef struct {
    mt_plan plan;
    buf_item bf[ACC_CU_MT];
    double *partials;               /* this launch's first partial: one per block */
    int p;                          /* 1, 2, or 0 for inf */
} norm_launch;

/* a thread's part of its chunk: sum of |x| or x^2 in fp64, or max |x| (NaN wins) */
static inline ACC_HD double norm_thread(const norm_launch *L, const buf_item *b, uint32_t blk, uint32_t tid,
                                        uint32_t nthr) {
    const uint64_t lo = (uint64_t)blk * ACC_CU_CHUNK, hi = cu_min64(lo + ACC_CU_CHUNK, b->n);
    double acc = 0.0;
    for (uint64_t i = lo + tid; i < hi; i += nthr) {
        const double x = fabs((double)ld1(b->data, b->dt, i));
        if (L->p == 2) acc = acc + x * x;
        else if (L->p == 1) acc = acc + x;
        else acc = (x > acc || x != x) && acc == acc ? x : acc;
    }
    return acc;
}

static inline ACC_HD double norm_combine(int p, double a, double b) {
    if (p) return a + b;
    if (a != a) return a;
    return b > a || b != b ? b : a;
}

/* a[0] = the tree combination of a[0 .. n) (n a power of two), the order every block and the finish use */
static inline ACC_HD void norm_tree_host(int p, double *a, int n) {
    for (int s = n / 2; s; s /= 2)
        for (int j = 0; j < s; j++) a[j] = norm_combine(p, a[j], a[j + s]);
}

__global__ void __launch_bounds__(ACC_CU_THREADS) k_norm(const norm_launch L) {
    __shared__ double part[ACC_CU_THREADS];
    const int t = mt_find(&L.plan, blockIdx.x);
    part[threadIdx.x] = norm_thread(&L, &L.bf[t], blockIdx.x - L.plan.first[t], threadIdx.x, blockDim.x);
    __syncthreads();
    for (int s = ACC_CU_THREADS / 2; s; s /= 2) {
        if ((int)threadIdx.x < s) part[threadIdx.x] = norm_combine(L.p, part[threadIdx.x], part[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x == 0) L.partials[blockIdx.x] = part[0];
}

__global__ void __launch_bounds__(ACC_CU_THREADS) k_norm_finish(const double *partials, uint64_t n, int p,
                                                                float *out) {
    __shared__ double part[ACC_CU_THREADS];
    double acc = 0.0;
    for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) acc = norm_combine(p, acc, partials[i]);
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = ACC_CU_THREADS / 2; s; s /= 2) {
        if ((int)threadIdx.x < s) part[threadIdx.x] = norm_combine(p, part[threadIdx.x], part[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = (float)(p == 2 ? sqrt(part[0]) : part[0]);
}

extern "C" size_t acc_cuda_norm_partials(const acc_cuda_buf *bufs, size_t nb) {
    size_t total = 0;
    for (size_t k = 0; k < nb; k++) total += (size_t)((bufs[k].n + ACC_CU_CHUNK - 1) / ACC_CU_CHUNK);
    return total ? total : 1;
}

/* the emulation of one block of k_norm (the same tree) */
static double norm_block_host(const norm_launch *L, uint32_t b) {
    double part[ACC_CU_THREADS];
    const int t = mt_find(&L->plan, b);
    for (uint32_t tid = 0; tid < ACC_CU_THREADS; tid++)
        part[tid] = norm_thread(L, &L->bf[t], b - L->plan.first[t], tid, ACC_CU_THREADS);
    norm_tree_host(L->p, part, ACC_CU_THREADS);
    return part[0];
}

static acc_status multi_norm(const acc_cuda_buf *bufs, size_t nb, double norm_type, double *partials, float *out,
                             void *stream, int emulate) {
    int p = norm_type == 2.0 ? 2 : norm_type == 1.0 ? 1 : isinf(norm_type) && norm_type > 0 ? 0 : -1;
    if (p < 0) {
        acc_set_error("multi_norm: norm_type %g is not supported (1, 2, inf)", norm_type);
        return ACC_ERR_ARG;
    }
    for (size_t k = 0; k < nb; k++) {
        acc_status st = check_float(bufs[k].dtype, k, "buffer");
        if (st) return st;
    }
    const size_t total = acc_cuda_norm_partials(bufs, nb);
    norm_launch *L = (norm_launch *)calloc(1, sizeof(norm_launch));
    if (!L) return ACC_ERR_NOMEM;
    L->p = p;
    acc_status st = ACC_OK;
    uint32_t blocks = 0;
    size_t done = 0;
    for (size_t k = 0; k <= nb && st == ACC_OK; k++) {
        const int last = k == nb;
        const uint32_t n = last ? 0 : (uint32_t)((bufs[k].n + ACC_CU_CHUNK - 1) / ACC_CU_CHUNK);
        if (L->plan.k && (last || L->plan.k == ACC_CU_MT || (uint64_t)blocks + n > ACC_CU_MAX_GRID)) {
            L->plan.first[L->plan.k] = blocks;
            L->partials = partials + done;
            if (emulate) {
                for (uint32_t b = 0; b < blocks; b++) partials[done + b] = norm_block_host(L, b);
            } else if (blocks) {
                k_norm<<<blocks, ACC_CU_THREADS, 0, (cudaStream_t)stream>>>(*L);
                st = cu_check("multi_norm");
            }
            done += blocks, L->plan.k = 0, blocks = 0;
        }
        if (last) break;
        L->plan.first[L->plan.k] = blocks;
        L->bf[L->plan.k].data = bufs[k].data, L->bf[L->plan.k].n = bufs[k].n, L->bf[L->plan.k++].dt = bufs[k].dtype;
        blocks += n;
    }
    free(L);
    if (st) return st;
    if (emulate) {
        double part[ACC_CU_THREADS];
        for (int tid = 0; tid < ACC_CU_THREADS; tid++) {
            double acc = 0.0;
            for (size_t i = (size_t)tid; i < done; i += ACC_CU_THREADS) acc = norm_combine(p, acc, partials[i]);
            part[tid] = acc;
        }
        norm_tree_host(p, part, ACC_CU_THREADS);
        *out = (float)(p == 2 ? sqrt(part[0]) : part[0]);
        return ACC_OK;
    }
    (void)total; /* (the caller's scratch holds at least `done` partials: acc_cuda_norm_partials) */
    k_norm_finish<<<1, ACC_CU_THREADS, 0, (cudaStream_t)stream>>>(partials, done, p, out);
    return cu_check("multi_norm");
}

extern "C" acc_status acc_cuda_multi_norm(const acc_cuda_buf *bufs, size_t nb, double norm_type, double *partials,
                                          float *out, void *stream) {
    return multi_norm(bufs, nb, norm_type, partials, out, stream, 0);
}

extern "C" acc_status acc_cuda_emulate_norm(const acc_cuda_buf *bufs, size_t nb, double norm_type, float *out) {
    double *partials = (double *)malloc(acc_cuda_norm_partials(bufs, nb) * sizeof(double));
    if (!partials) return ACC_ERR_NOMEM;
    acc_status st = multi_norm(bufs, nb, norm_type, partials, out, NULL, 1);
    free(partials);
    return st;
}

extern "C" acc_status acc_cuda_info(int *devices, int *runtime_version) {
    *devices = 0, *runtime_version = 0;
    cudaRuntimeGetVersion(runtime_version);
    if (cudaGetDeviceCount(devices) != cudaSuccess) {
        cudaGetLastError(); /* no driver / no device: not an error here */
        *devices = 0;
    }
    return ACC_OK;
}
